#!/usr/bin/env bash
# Build the extension here for the device machine (python 3.12, torch 2.11.0+cu130, sm_90) and
# put it in build/ext_cache/<hash>/, where device_call.sh finds it by the same hash of setup.py,
# csrc/ and cmake/: a device call then skips its ~150 s build. About 3 minutes on 2 cores, plus
# a one-time ~2 minutes for the venv (torch's wheel from PyPI into $VENV).
#   bash benchmarks/build_device_ext.sh            # this tree
#   bash benchmarks/build_device_ext.sh 557e5c5    # a commit's tree (an A/B's ref arm: REF_EXT)
# Prints the hash. Carry build/ext_cache (and .whl) in the device call.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-/tmp/v312}
PY312=${PY312:-$(command -v python3.12)}
if ! "$VENV/bin/python" -c "import torch; assert torch.__version__ == '2.11.0+cu130'" 2>/dev/null; then
  "$PY312" -m venv "$VENV"
  "$VENV/bin/pip" install -q "torch==2.11.0" numpy setuptools wheel ninja
fi
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
if [ $# -ge 1 ]; then
  git archive "$1" | tar -x -C "$src"
else  # tracked and untracked files that git does not ignore: what a device call carries
  git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - | tar -xf - -C "$src"
fi
hash=$(cd "$src" && cat setup.py $(find csrc cmake -type f -not -path "*__pycache__*" \
  | LC_ALL=C sort) | sha1sum | cut -c1-12)
(cd "$src" && TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda} \
  DELTASERVE_BUILD_EXT=1 MAX_JOBS=${MAX_JOBS:-2} "$VENV/bin/python" setup.py build_ext --inplace \
  > build.log 2>&1) || { tail -30 "$src/build.log"; exit 1; }
mkdir -p "build/ext_cache/$hash"
cp "$src"/python/deltaserve/_C*.so "build/ext_cache/$hash/"
echo "$hash"
