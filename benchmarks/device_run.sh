#!/usr/bin/env bash
# One device-machine session: build the extension for sm_90, run every gpu test, then the
# kernel, end-to-end and speculative benchmarks; logs and JSON go to $OUT.
# The device has no PyPI: fla-core travels as a wheel in .whl/ (see BUILD.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import torch, deltaserve.ops._ext as e; print('extension loaded:', e.extension_loaded())"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
if [ "${KERNELS:-1}" = 1 ]; then
  timeout 200 python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
  tail -25 "$OUT/bench_kernels.log"
fi
timeout 300 python3 benchmarks/bench_e2e.py --anchor --profile --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
grep -v "^\s*$" "$OUT/e2e.log" | tail -60
timeout 240 python3 benchmarks/bench_spec.py --out "$OUT/spec.json" > "$OUT/spec.log" 2>&1
tail -20 "$OUT/spec.log"
