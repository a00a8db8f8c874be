#!/usr/bin/env bash
# Same-machine A/B of kernel changes, step 1 (here, not on the device): the extension's sources
# at git ref $1 (default HEAD) into build/ab/$2 (default ref; git-ignored; carry "build/ab" to
# the device), without the default model's weights. Several refs (a branch per variant) go to
# several directories, timed together with `ab_gdn.py --config NAME=build/ab/NAME/python ...`. Kernel timings move 1-3% from one device machine to the
# next, so a change is judged against the reference built and timed in the same call
# (benchmarks/ab_gdn.py; RESULTS.md session 9 did it this way).
set -euo pipefail
cd "$(dirname "$0")/.."
REF="${1:-HEAD}"
DIR="build/ab/${2:-ref}"
rm -rf "$DIR"
mkdir -p "$DIR"
git archive "$REF" setup.py pyproject.toml cmake csrc python | tar -x -C "$DIR"
find "$DIR" -name '*.safetensors' -delete
git rev-parse --short "$REF" > "$DIR/REF"
echo "$DIR: $(cat "$DIR/REF") ($(du -sh "$DIR" | cut -f1))"
