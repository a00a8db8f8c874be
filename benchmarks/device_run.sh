#!/usr/bin/env bash
# One device-machine session: build the extension for sm_90, run the gpu tests, then the
# end-to-end and speculative benchmarks (and, with KERNELS=1, the kernel benchmark); logs and
# JSON go to $OUT. The device has no PyPI: fla-core travels as a wheel in .whl/ (BUILD.md).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
python3 -c "import torch, deltaserve.ops._ext as e; print('extension loaded:', e.extension_loaded())"
run_tests() {  # $1: log name, rest: test paths
  local log=$1; shift
  timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider "$@" > "$OUT/$log" 2>&1
  grep -E "passed|failed|error" "$OUT/$log" | tail -3
}
run_tests gpu_engine.log tests/engine tests/spec
timeout 200 python3 benchmarks/bench_e2e.py --anchor --profile --out "$OUT/e2e.json" > "$OUT/e2e.log" 2>&1
grep -E "^(model|prefill|decode|ttft|anchor|followup)" "$OUT/e2e.log"
timeout 150 python3 benchmarks/bench_spec.py --batches 1,8 --ks 1,2,3,4 --max-tokens 48 \
  --out "$OUT/spec.json" > "$OUT/spec.log" 2>&1
tail -20 "$OUT/spec.log"
run_tests gpu_rest.log tests/ops tests/model tests/cache
if [ "${KERNELS:-0}" = 1 ]; then
  timeout 200 python3 benchmarks/bench_kernels.py --out "$OUT/bench_kernels.json" > "$OUT/bench_kernels.log" 2>&1
  tail -25 "$OUT/bench_kernels.log"
fi
