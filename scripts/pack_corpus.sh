#!/usr/bin/env bash
# Pack a prepared corpus (scripts/prepare_corpus.py --out build/corpus [--extra-site ...]) into
# build/corpus.tar.xz, the file benchmarks/device_train.sh unpacks on the device (git-ignored),
# and split it into build/corpus_parts/part-* of at most PART_SIZE bytes (default 24M) with
# PARTS (their order) and SHA256SUMS: a device call carries the working tree and its carried
# paths within 64 MiB, and the tree (with the default model's weights) is about 41 MB, so a
# larger corpus travels one part per call (`MODE=stage bash benchmarks/device_train.sh`,
# docs/default_model.md).
set -euo pipefail
src=${1:-build/corpus}
tar -C "$src" -cf - . | xz -T0 -9 > build/corpus.tar.xz
rm -rf build/corpus_parts && mkdir -p build/corpus_parts
split -b "${PART_SIZE:-24M}" build/corpus.tar.xz build/corpus_parts/part-
(cd build/corpus_parts && ls part-* > PARTS)
(cd build && sha256sum corpus.tar.xz > corpus_parts/SHA256SUMS)
ls -la build/corpus.tar.xz build/corpus_parts
