#!/usr/bin/env bash
# Set up deltaserve in ./.venv: torch, the package and its test tools.
# The CUDA extension is built when a CUDA toolkit is found (DELTASERVE_BUILD_EXT=0|1 forces it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import torch, numpy" 2>/dev/null; then
  # torch 2.14.1 is a CUDA 13.0 build: it runs on the CPU too and can build the extension;
  # numpy with it, or importing torch below prints "Failed to initialize NumPy"
  .venv/bin/pip install -q "torch==2.14.1" numpy
fi
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
  export CUDA_HOME=/usr/local/cuda
fi
if [ -z "${TORCH_CUDA_ARCH_LIST:-}" ]; then
  # build for this machine's GPU only (sm_90 where there is none: what CI compile-checks)
  TORCH_CUDA_ARCH_LIST=$(.venv/bin/python -c 'import torch
c = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
print(f"{c[0]}.{c[1]}")')
  export TORCH_CUDA_ARCH_LIST
fi
# pip would rebuild the extension on every run (about 1.5 minutes): skip it when the install
# was made with the same build settings and no kernel source or build file changed since.
settings="build_ext=${DELTASERVE_BUILD_EXT:-auto} cuda=${CUDA_HOME:-} arch=${TORCH_CUDA_ARCH_LIST}"
stamp=.venv/.deltaserve-install
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$settings" ] \
    && [ -z "$(find csrc cmake setup.py pyproject.toml -newer "$stamp" -print -quit)" ] \
    && .venv/bin/python -c "import deltaserve" 2>/dev/null; then
  echo "deltaserve is installed in $(pwd)/.venv (up to date: $settings)"
  exit 0
fi
rm -f "$stamp"
.venv/bin/pip install -q --no-build-isolation -e ".[test]"
echo "$settings" > "$stamp"
echo "deltaserve is installed in $(pwd)/.venv"
