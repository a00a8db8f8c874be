# Sourced by the device-side scripts (device_run.sh, device_ab.sh): $OUT made, the wheels carried
# in .whl/ installed, and the environment the builds, tests and benchmarks need. A GPU machine
# without PyPI gets fla-core as a wheel, fetched beforehand on a machine with PyPI:
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl fla-core==0.6.0
# (.whl/ is git-ignored; copy it to the GPU machine with the checkout.)
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD/python PYTHONUNBUFFERED=1
export TORCH_CUDA_ARCH_LIST=9.0 CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
# nothing outside the device machine can be reached: no library waits on a network timeout
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 MPLBACKEND=Agg
