# Sourced by the device-side scripts (device_run.sh, device_ab.sh): $OUT made, the wheels carried
# in .whl/ installed (the device has no PyPI: BUILD.md), and the environment the builds, tests
# and benchmarks need.
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
