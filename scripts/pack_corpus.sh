#!/usr/bin/env bash
# Pack a prepared corpus (scripts/prepare_corpus.py --out build/corpus [--extra-site ...]) into
# build/corpus.tar.xz, the file benchmarks/device_train.sh unpacks on the device (git-ignored;
# about 25 MB with the extra split, inside the 64 MiB a device call carries).
set -euo pipefail
src=${1:-build/corpus}
tar -C "$src" -cf - . | xz -T0 -9 > build/corpus.tar.xz
ls -la build/corpus.tar.xz
