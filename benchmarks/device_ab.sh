#!/usr/bin/env bash
# Device side of a same-machine A/B of kernel changes, in one call: builds the working tree and
# every tree under build/ab/ (made here with benchmarks/ab_prepare.sh REF NAME) side by side, runs
# the kernel and model gpu tests on the working tree, then times every build with ab_gdn.py
# (build/ab/ref first, so ratios are to it). Logs and JSON go to $OUT. Carry ".whl" and
# "build/ab". Session 10 ran this sequence by hand four times.
#   AB_ARGS="--batches 1,8,64,256 --rounds 2 --conv" TESTS=1 bash benchmarks/device_ab.sh
#   (AB_CONFIGS: extra LABEL=PYTHON_DIR[,NAME=VALUE...] configurations, space-separated;
#   TESTS_ARGS: what pytest -m gpu runs, default "tests/ops tests/model" (~70 s); e.g.
#   "tests/ops/test_gdn_gpu.py -k verify" took 2 s in session 12's last call; all gpu tests but
#   tests/server, whose uvicorn the device lacks, need over 250 s; the last of them, the
#   engine's folded-replay test, alone took 85 s in session 15 (it passed), so give it its own
#   call or TESTS_TIMEOUT; test_gdn_gpu.py alone took 27 s)
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
shopt -s nullglob
trees=()
for t in build/ab/*/; do trees+=("${t%/}"); done
jobs=$(( $(nproc) / (${#trees[@]} + 1) ))
[ "$jobs" -lt 2 ] && jobs=2
for t in "${trees[@]}"; do
  (cd "$t" && python3 setup.py build_ext --inplace -j "$jobs" > "$OUT/build_$(basename "$t").log" 2>&1 \
    || echo "build failed: $t") &
done
python3 setup.py build_ext --inplace -j "$jobs" > "$OUT/build.log" 2>&1 \
  || { tail -30 "$OUT/build.log"; exit 1; }
wait
echo "built in ${SECONDS}s: working tree ${trees[*]}"
if [ "${TESTS:-1}" = 1 ]; then
  # shellcheck disable=SC2086  # TESTS_ARGS is a list of pytest arguments
  timeout -s KILL "${TESTS_TIMEOUT:-150}" python3 -m pytest -m gpu -q -p no:cacheprovider \
    ${TESTS_ARGS:-tests/ops tests/model} > "$OUT/gpu_ops.log" 2>&1
  echo "gpu tests (exit $?): $(grep -E "passed|failed|error" "$OUT/gpu_ops.log" | tail -1)"
fi
configs=()
[ -d build/ab/ref ] && configs+=(--config ref=build/ab/ref/python)
configs+=(--config new=python)
for t in "${trees[@]}"; do
  [ "$t" != build/ab/ref ] && configs+=(--config "$(basename "$t")=$t/python")
done
# more builds-with-environments, e.g. AB_CONFIGS="rows1=build/ab/ref/python,DS_GDN_ROWS=1"
for c in ${AB_CONFIGS:-}; do configs+=(--config "$c"); done
# shellcheck disable=SC2086  # AB_ARGS is a list of options
# AB_SCRIPT=ab_attention.py times the paged attention kernels instead (same --config syntax)
ab=${AB_SCRIPT:-ab_gdn.py}
timeout -s KILL "${AB_TIMEOUT:-300}" python3 "benchmarks/$ab" "${configs[@]}" ${AB_ARGS:-} \
  --out "$OUT/ab.json" > "$OUT/ab.log" 2>&1
echo "$ab (exit $?), ${SECONDS}s:"
tail -60 "$OUT/ab.log"
