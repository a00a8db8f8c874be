#!/usr/bin/env bash
# Device-side runs of the default model's training (issue 33); no extension build needed.
# Needs build/corpus.tar.xz carried (scripts/pack_corpus.sh); the encoded corpus, the chosen
# variant and the checkpoint stay in /tmp on the machine between calls.
#   MODE=auto bash benchmarks/device_train.sh     (the same command in each call)
#       first call: profile each of $VARIANTS (one flag list per line) over 3 steps, keep the
#       fastest, and train with it until the call's time is nearly up (checkpoint, exit 3);
#       later calls resume it (exit 3 again while it is unfinished: run it again within 30 s,
#       before the idle machine is given back). $TRAIN_FLAGS go to every training call.
#   MODE=probe VARIANTS=$'--mtp-fraction 0.25\n--compile inductor' bash benchmarks/device_train.sh
#       only the profiles (OUT/probe.log, their op tables; OUT/probe.tsv, tokens/s).
# A finished run leaves in OUT model.safetensors.part-* (files of 15 MB: what comes back) and
# dm_meta.tar.gz (config.json, README.md, train_log.json, loss.png, sha256); unpack them here
# with scripts/unpack_default_model.sh.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python3 - <<'PY'
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton",
      triton.__version__, torch.cuda.get_device_name())
PY
# the retraining's architecture (docs/default_model.md, "Retraining"): 17.0 M + 1.9 M MTP
ARCH="--arch hidden_size=384 --arch linear_num_key_heads=6 --arch linear_num_value_heads=12"
CALL_S=${CALL_S:-570}  # this call's time limit, less a margin (the device's is 600 s)
VARIANTS=${VARIANTS:-$'--mtp-fraction 0.25\n--mtp-fraction 0.25 --gdn-solve blocked\n--mtp-fraction 0.25 --gdn-solve blocked --conv shift --compile inductor'}
run=/tmp/dm_run
[ -f /tmp/corpus_full/manifest.json ] || { mkdir -p /tmp/corpus_full && tar -xJf build/corpus.tar.xz -C /tmp/corpus_full; }
COMMON="--corpus /tmp/corpus_full --token-cache /tmp/dm_tokens $ARCH"

probe() {  # profile each variant; print "tokens/s<TAB>variant" lines to $OUT/probe.tsv
  local i=0 variant t rate
  : > "$OUT/probe.tsv"
  while IFS= read -r variant; do
    i=$((i + 1)); t=$SECONDS
    # shellcheck disable=SC2086  # flag lists
    timeout -s KILL "${PROBE_T:-300}" python3 scripts/train_default_model.py --out "/tmp/probe$i" \
      $COMMON --profile-steps 3 ${TRAIN_FLAGS:-} $variant > "/tmp/probe$i.log" 2>&1
    { echo "== probe $i [$variant]"; cat "/tmp/probe$i.log"; } >> "$OUT/probe.log"
    rate=$(grep -oE "[0-9,]+ tokens/s \(profiler on\)" "/tmp/probe$i.log" | head -1 | cut -d' ' -f1 | tr -d ,)
    echo "== probe $i [$variant] $((SECONDS - t)) s: ${rate:-failed} tokens/s"
    grep -E "out of memory|Error" "/tmp/probe$i.log" | head -3
    [ -n "$rate" ] && printf '%s\t%s\n' "$rate" "$variant" >> "$OUT/probe.tsv"
  done <<< "$VARIANTS"
}

case "${MODE:-auto}" in
probe) probe ;;
auto)
  resume=""
  if [ -f "$run/checkpoint.pt" ]; then
    resume="--resume"
  else
    probe
    [ -s "$OUT/probe.tsv" ] || { echo "no variant ran"; exit 1; }
    sort -rn "$OUT/probe.tsv" | head -1 | cut -f2 > /tmp/dm_variant
  fi
  variant=$(cat /tmp/dm_variant)
  # training time left in this call: start-up (imports, the cached corpus, the model) and the
  # final evaluation and save take about 45 s besides
  stop=$(python3 -c "print(max(1.0, ($CALL_S - $SECONDS - 45) / 60))")
  echo "== train [$variant] $resume --stop-minutes $stop"
  t=$SECONDS
  # shellcheck disable=SC2086  # flag lists
  python3 scripts/train_default_model.py --out "$run" $COMMON ${TRAIN_FLAGS:-} $variant \
    --stop-minutes "$stop" $resume > /tmp/train.log 2>&1
  rc=$?
  cat /tmp/train.log >> "$OUT/train.log"
  echo "== train rc=$rc $((SECONDS - t)) s"; grep -vE "^step " /tmp/train.log | tail -20
  if [ $rc = 0 ]; then
    (cd "$run" && sha256sum model.safetensors > sha256 \
      && split -b 15M model.safetensors "$OUT/model.safetensors.part-" \
      && tar -czf "$OUT/dm_meta.tar.gz" config.json README.md train_log.json sha256 $(ls loss.png 2>/dev/null))
    ls -la "$OUT"
  fi
  exit $rc
  ;;
esac
