#!/usr/bin/env bash
# One device call in steps, each under its own timeout, logs collected under $OUT (steps.log,
# results.jsonl: see collect below); the extension is built once (or taken from
# build/ext_cache when its csrc hash matches) and saved to $OUT for reuse.
#   STEPS="gemvtest profile stepoff mtptest spec" bash benchmarks/device_call.sh
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
STEPS=${STEPS:-}
has() { [[ " $STEPS " == *" $1 "* ]]; }
# the same files in the same order on every machine (a locale's collation would reorder them):
# an extension built elsewhere (benchmarks/build_device_ext.sh) is found by this hash
hash=$(cat setup.py $(find csrc cmake -type f -not -path "*__pycache__*" | LC_ALL=C sort) | sha1sum | cut -c1-12)
# a cached extension may travel xz-compressed (2.8 MB against 17: the tree with the default
# model's weights is 41 MB of the 64 MiB a call carries): $OUT's ext_<hash>/*.so.xz as it came back
for h in $hash ${REF_EXT:-}; do  # only the two this call can use
  for xz_so in build/ext_cache/$h/*.so.xz; do
    [ -f "$xz_so" ] && [ ! -f "${xz_so%.xz}" ] && xz -dk "$xz_so"
  done
done
so=$(ls build/ext_cache/$hash/*.so 2>/dev/null | head -1)
if [ -n "$so" ]; then
  cp "$so" python/deltaserve/ && echo "extension from cache $hash"
else
  t=$SECONDS
  python3 setup.py build_ext --inplace -j 16 > "$OUT/build.log" 2>&1 || { tail -30 "$OUT/build.log"; exit 1; }
  echo "built in $((SECONDS - t)) s"
  mkdir -p "$OUT/ext_$hash" && cp python/deltaserve/_C*.so "$OUT/ext_$hash/" && xz -T8 -3 "$OUT/ext_$hash/"*.so
  ls -la "$OUT/ext_$hash"
fi
python3 -c "import torch, deltaserve.ops._ext as e; print('extension loaded:', e.extension_loaded())"
# Only a few files under $OUT come back (a call's files past about 8 are left out), so each
# step's log and outputs go to $LOGS and are appended to $OUT/steps.log (logs, text outputs) and
# $OUT/results.jsonl (one {"file", "data"} line per JSON output) as soon as the step ends: a call
# cut by its time limit still returns every finished step.
LOGS=/tmp/ds_logs && mkdir -p "$LOGS"
collect() {  # name rc seconds
  { echo "== $1 rc=$2 $3s"; cat "$LOGS/$1.log"; } >> "$OUT/steps.log"
  for f in "$LOGS"/*.json "$LOGS"/*.txt; do
    [ -f "$f" ] && [ ! -f "$f.sent" ] || continue
    if [ "${f%.json}" != "$f" ]; then echo "{\"file\": \"$(basename "$f")\", \"data\": $(cat "$f")}" >> "$OUT/results.jsonl"
    else { echo "== $(basename "$f")"; cat "$f"; } >> "$OUT/steps.log"; fi
    touch "$f.sent"
  done
}
run() {  # name timeout cmd...
  local name=$1 lim=$2; shift 2; local t=$SECONDS
  timeout -s KILL "$lim" "$@" > "$LOGS/$name.log" 2>&1; local rc=$?
  echo "== $name rc=$rc $((SECONDS - t))s"; tail -${TAILN:-6} "$LOGS/$name.log"
  collect "$name" "$rc" "$((SECONDS - t))"
}
has gemvtest && run gemvtest 70 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/ops/test_linear_gpu.py
# the gemv GPU tests with DS_GEMV_VARIANT=$SMEM_VARIANT: 1 (default here: the copied tile, whose
# results the default 3 shares: bit 2 moves only when the next kernel launches), 0 (registers)
has smemtest && DS_GEMV_VARIANT=${SMEM_VARIANT:-1} TAILN=12 run smemtest 200 python3 -m pytest -m gpu -q -p no:cacheprovider tests/ops/test_linear_gpu.py tests/ops/test_prologue_gpu.py
# shellcheck disable=SC2086  # GPU_TESTS is a list of test paths
has gputests && TAILN=25 run gputests ${TESTS_T:-200} python3 -m pytest -m gpu -q -p no:cacheprovider --timeout=120 ${GPU_TESTS:-tests/engine/test_gpu_overlap.py}
# same-call A/B of a csrc change: the extension of csrc hash $REF_EXT (build/ext_cache/$REF_EXT,
# carried; run with DS_GEMV_PROLOGUE=0, as it has no prologue kernels) beside this tree's with
# the gemv prologues off ("pdl") and on ("new"), in turn, on the step figures of the 0.8B config
# ($AB08 arms) and the default model ($ABDEF arms): graph device time per step, tok/s
# use_ext ref|new: the extension of csrc hash $REF_EXT (build/ext_cache, carried) or this tree's
so_name=$(basename "$(ls python/deltaserve/_C*.so | head -1)")
cp "python/deltaserve/$so_name" /tmp/new_ext.so
use_ext() {
  if [ "$1" = ref ]; then cp build/ext_cache/${REF_EXT:?}/*.so "python/deltaserve/$so_name"
  else cp /tmp/new_ext.so "python/deltaserve/$so_name"; fi
}
if has abext; then
  ab_run() {  # arm name bench_e2e-args...
    local arm=$1 name=$2; shift 2
    if [ "$arm" = ref ]; then use_ext ref; else use_ext new; fi
    local pro=1 var=${DS_GEMV_VARIANT:-}; [ "$arm" = ref ] || [ "$arm" = pdl ] && pro=0
    [[ $arm == v* ]] && var=${arm#v}  # vN: this tree's extension with DS_GEMV_VARIANT=N
    DS_GEMV_VARIANT=$var DS_GEMV_PROLOGUE=$pro TAILN=8 run "$name" 100 python3 benchmarks/bench_e2e.py "$@" --step-only --out "$LOGS/$name.json"
  }
  i=0
  for arm in ${AB08:-ref pdl new ref new}; do i=$((i + 1)); ab_run "$arm" "ab08_${arm}$i" --vocab 248320; done
  for arm in ${ABDEF:-ref new}; do i=$((i + 1)); ab_run "$arm" "abdef_${arm}$i" --model default; done
  use_ext new
fi
# same-call A/B of the gemv row limits: the 0.8B config's step figures (batches $ROWSAB_B) for
# each arm of $ROWSAB_ARMS in turn, an arm "R" or "R-W" or "R-W-V": DS_GEMV_MAX_ROWS=R (8: the
# kernel up to 8 rows, cuBLAS above), DS_GEMV_WIDE_MAX_ROWS=W, DS_GEMV_VARIANT=V (e.g.
# "32-32-7": every grid up to 32 rows, the register path past 8 rows); "ref": the extension of
# csrc hash $REF_EXT with $REF_ROWS rows (default 8)
if has rowsab; then
  i=0; for arm in ${ROWSAB_ARMS:-8 32 8 32}; do
    i=$((i + 1)); IFS=- read -r rows wide var <<< "$arm"
    if [ "$arm" = ref ]; then use_ext ref; rows=${REF_ROWS:-8}; else use_ext new; fi
    DS_GEMV_MAX_ROWS=$rows DS_GEMV_WIDE_MAX_ROWS=${wide:-} DS_GEMV_VARIANT=${var:-} TAILN=${ROWSAB_TAIL:-4} run "rows${arm}_$i" 120 python3 benchmarks/bench_e2e.py --vocab 248320 --step-only --step-batches ${ROWSAB_B:-1,32} --out "$LOGS/rows${arm}_$i.json"
  done
  use_ext new
fi
# where a decode step's device time goes, kernel by kernel, at batch 1 and 32 (0.8B config)
has profstep && TAILN=4 run profstep 150 python3 benchmarks/bench_e2e.py --vocab 248320 --step-only --profile --out "$LOGS/profstep.json"
# bench_linear once per DS_GEMV_VARIANT in $LINEAR_VARIANTS (default: the variable's value, else
# "default": the variable unset, the kernel's own default)
for v in ${LINEAR_VARIANTS:-${DS_GEMV_VARIANT:-default}}; do
  has linear && DS_GEMV_VARIANT=${v#default} run linear_v$v 60 python3 benchmarks/bench_linear.py --rows ${LINEAR_ROWS:-1,2,4,8} --out "$LOGS/linear_v$v.json"
done
has profile && TAILN=12 run profile 170 python3 benchmarks/profile_step.py --vocab 248320 --out "$LOGS/profile.txt"
# the default model's plain decode step, the same way (the baseline of profmtp's spans)
has profdef && TAILN=12 run profdef 170 python3 benchmarks/profile_step.py --model default --out "$LOGS/profile_def.txt"
# issue 30: a verify step's host time beside its kernels (default model, MTP k = 3, fixed policy)
has profmtp && TAILN=12 run profmtp 170 python3 benchmarks/profile_step.py --model default --spec mtp --out "$LOGS/profile_mtp.txt"
# MTP on with every step forced plain (issue 30: the 8-14% that being on costs, against profdef)
has profmtpplain && TAILN=12 run profmtpplain 170 python3 benchmarks/profile_step.py --model default --spec mtp --plain --out "$LOGS/profile_mtp_plain.txt"
# the same with verify steps chained (--overlap-verify): device time per step beside the wall
has profmtpov && TAILN=12 run profmtpov 170 python3 benchmarks/profile_step.py --model default --spec mtp --overlap-verify --out "$LOGS/profile_mtp_ov.txt"
has stepoff && DS_GEMV_MAX_ROWS=0 run stepoff 90 python3 benchmarks/bench_e2e.py --vocab 248320 --step-only --disable-overlap-schedule --out "$LOGS/stepoff.json"
has e2e08 && TAILN=30 run e2e08 ${E2E_T:-240} python3 benchmarks/bench_e2e.py --vocab 248320 --profile --out "$LOGS/e2e08.json"
has e2edef && TAILN=20 run e2edef 150 python3 benchmarks/bench_e2e.py --model default --out "$LOGS/e2edef.json"
# same-call A/B of an environment setting of this tree: bench_e2e on the 0.8B config and the
# default model with $ENV_AB (e.g. "DS_PREFILL_GRAPH_TOKENS=0") set ("set") and not ("unset"),
# in turn, twice each (ENVAB_ARMS: another order or count; ENVAB_DEF=0: the 0.8B config only)
if has envab; then
  i=0; for arm in ${ENVAB_ARMS:-set unset set unset}; do
    i=$((i + 1)); envs=(); [ $arm = set ] && read -ra envs <<< "${ENV_AB:?}"
    TAILN=4 run "e2e08_$arm$i" 120 env "${envs[@]}" python3 benchmarks/bench_e2e.py --vocab 248320 --out "$LOGS/e2e08_$arm$i.json"
    [ "${ENVAB_DEF:-1}" = 1 ] && TAILN=4 run "e2edef_$arm$i" 120 env "${envs[@]}" python3 benchmarks/bench_e2e.py --model default --out "$LOGS/e2edef_$arm$i.json"
  done
fi
# same-call A/B of python-only changes: the default model under build/ab/ref's python (made by
# `bash benchmarks/ab_prepare.sh <commit>`; it shares this extension, so csrc must be the same)
# and under HEAD's, twice each in turn (this host-bound model's runs vary up to 2x)
if has e2edef_ab; then
  cp python/deltaserve/_C*.so build/ab/ref/python/deltaserve/
  cp python/deltaserve/default_model/files/model.safetensors build/ab/ref/python/deltaserve/default_model/files/
  head_path=$PYTHONPATH; i=0
  for side in ref head ref head; do
    i=$((i + 1)); export PYTHONPATH=$head_path
    [ $side = ref ] && export PYTHONPATH=/tmp/site:$PWD/build/ab/ref/python
    TAILN=8 run e2edef_$side$i 120 python3 benchmarks/bench_e2e.py --model default --out "$LOGS/e2edef_$side$i.json"
  done
  export PYTHONPATH=$head_path
fi
# issue 27: one-time TTFT costs by prompt length and the cached follow-up's extra time, profiled
has ttftcosts && TAILN=${TTFT_TAIL:-40} run ttftcosts ${TTFT_T:-240} python3 benchmarks/probe_ttft_costs.py --vocab 248320 ${TTFT_ARGS:-} --out "$LOGS/ttft_costs.json"
# same-call A/B of a python-only change to the cached follow-up (issue 27's ratio): the probe's
# follow-up part under build/ab/ref's python (bash benchmarks/ab_prepare.sh <commit>) and
# HEAD's, in turn ($TTFTAB_SIDES; $TTFTAB_ARGS: the probe's flags, e.g. "--skip-followup
# --lengths 200,256,300,500": the TTFT at new lengths instead)
if has ttftab; then
  cp python/deltaserve/_C*.so build/ab/ref/python/deltaserve/
  head_path=$PYTHONPATH; i=0
  for side in ${TTFTAB_SIDES:-ref head}; do
    i=$((i + 1)); export PYTHONPATH=$head_path
    [ $side = ref ] && export PYTHONPATH=/tmp/site:$PWD/build/ab/ref/python
    TAILN=2 run ttft_$side$i ${TTFTAB_T:-150} python3 benchmarks/probe_ttft_costs.py --vocab 248320 ${TTFTAB_ARGS:---skip-lengths} --out "$LOGS/ttft_$side$i.json"
    grep -h "^follow-up\|^TTFT at" "$LOGS/ttft_$side$i.log"
  done
  export PYTHONPATH=$head_path
fi
has ttftcostsdef && TAILN=20 run ttftcostsdef 150 python3 benchmarks/probe_ttft_costs.py --model default --out "$LOGS/ttft_costs_def.json"
has moebench && TAILN=20 run moebench 90 python3 benchmarks/bench_moe.py --out "$LOGS/moe.json"
# Qwen3-Next-80B-A3B's first $NEXT_LAYERS layers (all 48 need two H200s in bf16)
has next80 && TAILN=25 run next80 ${NEXT_T:-200} python3 benchmarks/bench_e2e.py --config qwen3-next-80b-a3b --layers ${NEXT_LAYERS:-12} --out "$LOGS/next80.json"
# $MOE_ARGS: e.g. "--reserve-gb 6 --snapshot-slots 4" (the 35B-A3B weights on an 80 GB H100)
# shellcheck disable=SC2086  # a flag list
has moe35 && TAILN=${MOE_TAIL:-25} run moe35 ${MOE_T:-300} python3 benchmarks/bench_e2e.py --config qwen3.6-35b-a3b ${MOE_ARGS:-} --out "$LOGS/moe35.json"
has long && TAILN=10 run long 150 python3 benchmarks/bench_e2e.py --vocab 248320 --long-context --out "$LOGS/long.json"
# issue 28: the paged attention kernels once per arm of $ATTN_ARMS: "ref" (the extension of
# csrc hash $REF_EXT, carried in build/ext_cache), a number (this tree's, with
# DS_ATTN_BLOCKS_PER_SM set to it; 0: the kernel's own figure) or "ldsm" (this tree's with
# DS_ATTN_LDMATRIX=1: the fragments through ldmatrix)
if has attn; then
  for arm in ${ATTN_ARMS:-0}; do
    ldsm=0; bps=0
    if [ "$arm" = ref ]; then use_ext ref; else use_ext new; fi
    if [ "$arm" = ldsm ]; then ldsm=1; elif [ "$arm" != ref ]; then bps=$arm; fi
    DS_ATTN_LDMATRIX=$ldsm DS_ATTN_BLOCKS_PER_SM=$bps run "attn_$arm" 90 python3 benchmarks/bench_attention.py --batches ${ATTN_B:-1,8} --contexts ${ATTN_CTX:-128,8192,16384,32768} --page-sizes 16 --gather-gb 0 ${ATTN_PROF:+--profile} --out "$LOGS/attn_$arm.json"
  done
  use_ext new
fi
# Nsight Compute on one graph-replayed launch of the attention kernel per case of $NCU_CASES
# ("B:ctx:R", e.g. "8:8192:1 1:32768:1"): the details page to steps.log, the SASS source page
# (for `python benchmarks/ncu_gdn.py summary`) as $OUT/ncu_<case>.csv
if has attnncu; then
  for c in ${NCU_CASES:-8:8192:1 1:32768:1}; do
    IFS=: read -r nb nctx nr <<< "$c"; tag=b${nb}_${nctx}_r$nr
    # profile, then both pages exported, in one step (its collect picks up the details)
    run "ncu_$tag" 150 bash -c "ncu -k regex:${NCU_KERNEL:-paged_attn_kernel} --launch-skip 40 \
      --launch-count 1 --section SpeedOfLight --section MemoryWorkloadAnalysis \
      --section Occupancy --section WarpStateStats --section SchedulerStats \
      --section InstructionStats --section SourceCounters -o /tmp/ncu_$tag \
      python3 benchmarks/bench_attention.py --batches $nb --contexts $nctx --rows $nr \
      --page-sizes 16 --gather-gb 0 --chain 1 --out /tmp/ncu_$tag.json &&
      ncu -i /tmp/ncu_$tag.ncu-rep --page details > $LOGS/ncu_${tag}_details.txt 2>&1 &&
      ncu -i /tmp/ncu_$tag.ncu-rep --page source --csv --print-source sass > $OUT/ncu_$tag.csv"
  done
fi
# where a batch-8 decode step's time goes at context 128 and 16k (after the long-context rows)
has longprof && TAILN=4 run longprof 200 python3 benchmarks/bench_e2e.py --vocab 248320 --long-context --profile --out "$LOGS/longprof.json"
has mtptest && run mtptest 90 python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/spec/test_gpu_mtp_graph.py
# once per workload in $SPEC_W (heldout: build/spec_corpus's files; repetitive); $SPEC_TOKENS
# tokens a request (64), $SPEC_ROUNDS rounds (5)
for w in ${SPEC_W:-heldout}; do
  has spec && TAILN=${SPEC_TAIL:-14} run spec_$w ${SPEC_T:-150} python3 benchmarks/bench_spec.py --workload $w --corpus build/spec_corpus --batches ${SPEC_B:-1,32} --ks 3 --max-tokens ${SPEC_TOKENS:-64} --rounds ${SPEC_ROUNDS:-5} --policies ${SPEC_P:-fixed,adaptive} --overlap-verify ${SPEC_OV:-off} --out "$LOGS/spec_$w.json"
done
# issue 30's 0.8B-config figures: a verify step (k = 3) and an MTP draft step against a plain
# decode step (random weights with one MTP layer; n-gram on the repetitive workload)
has spec08 && TAILN=${SPEC_TAIL:-14} run spec08 ${SPEC08_T:-200} python3 benchmarks/bench_spec.py --config 0.8b --workload repetitive --batches ${SPEC08_B:-1,32} --ks 3 --max-tokens 64 --policies ${SPEC08_P:-fixed} --overlap-verify ${SPEC08_OV:-off,on} --out "$LOGS/spec08.json"
# issue 27, prefill: GPU tests of the prefill path (~2-4 min on a machine that has not compiled
# fla-core's kernels yet), then TTFT-256 / 8k prefill beside kernels per forward
has prefilltest && TAILN=12 run prefilltest ${PREFILLTEST_T:-400} python3 -m pytest -m gpu -q -x -p no:cacheprovider tests/ops/test_gdn_prefill_gpu.py tests/ops/test_conv_qkv_gpu.py tests/engine/test_gpu_prefill_attention.py tests/engine/test_gpu_prefill.py
has prefill && TAILN=10 run prefill ${PREFILL_T:-240} python3 benchmarks/bench_prefill.py --compare --out "$LOGS/prefill.json"
# the bf16 MoE test's first token: each ops module's kernels off in turn beside the fp32 oracle
has bisect && TAILN=14 run bisect 240 python3 scripts/bisect_ops.py --tiny qwen3_5_moe_text --seed 4 --dtype bfloat16 --prompt-len 100 --prompt-seed 7 --out "$LOGS/bisect.json"
# issue 33's training profiles and runs: benchmarks/device_train.sh (no extension build)
echo "total ${SECONDS}s"
