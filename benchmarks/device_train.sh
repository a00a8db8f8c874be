#!/usr/bin/env bash
# Device-side runs of the default model's training (issue 33); no extension build needed.
#   MODE=probe VARIANTS=$'--mtp-fraction 0.25\n--compile inductor' bash benchmarks/device_train.sh
#       the step time of training variants (one per line; an empty line is the recipe as
#       is), each profiled over 3 steps: OUT/probe<i>.log
#   MODE=train TRAIN_FLAGS="--max-minutes 15.5 --stop-minutes 8" bash benchmarks/device_train.sh
#       train on build/corpus.tar.xz (carried; made by scripts/pack_corpus.sh), resuming from
#       /tmp/dm_run/checkpoint.pt and reusing /tmp/dm_tokens when an earlier call on this
#       machine left them (the command exits 3 while a checkpoint remains: run it again
#       within 30 s, before the idle machine is given back). A finished run leaves in OUT
#       model.safetensors.part-* (16 MiB files come back; join with cat, check sha256) and
#       dm_meta.tar.gz (config.json, README.md, train_log.json, loss.png, sha256).
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
python3 - <<'PY'
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton",
      triton.__version__, torch.cuda.get_device_name())
PY
# the retraining's architecture (docs/default_model.md, "Retraining"): 17.0 M + 1.9 M MTP
ARCH="--arch hidden_size=384 --arch linear_num_key_heads=6 --arch linear_num_value_heads=12"
case "${MODE:-probe}" in
probe)
  # a stdlib-only corpus made on the machine: the step time does not depend on the text
  python3 scripts/prepare_corpus.py --out /tmp/corpus > "$OUT/corpus.log" 2>&1 || tail "$OUT/corpus.log"
  i=0
  while IFS= read -r variant; do
    i=$((i + 1)); t=$SECONDS
    # shellcheck disable=SC2086  # ARCH and the variant are flag lists
    timeout -s KILL "${PROBE_T:-300}" python3 scripts/train_default_model.py --out "/tmp/probe$i" \
      --corpus /tmp/corpus --no-extra --profile-steps 3 $ARCH $variant > "$OUT/probe$i.log" 2>&1
    echo "== probe $i [$variant] rc=$? $((SECONDS - t)) s"
    grep -E "throughput|steps profiled|out of memory|Error" "$OUT/probe$i.log" | head -5
  done <<< "${VARIANTS:-}"
  ;;
train)
  run=/tmp/dm_run
  [ -f /tmp/corpus_full/manifest.json ] || { mkdir -p /tmp/corpus_full && tar -xJf build/corpus.tar.xz -C /tmp/corpus_full; }
  resume=""; [ -f "$run/checkpoint.pt" ] && resume="--resume"
  t=$SECONDS
  # shellcheck disable=SC2086  # flag lists
  python3 scripts/train_default_model.py --out "$run" --corpus /tmp/corpus_full \
    --token-cache /tmp/dm_tokens $ARCH \
    ${TRAIN_FLAGS:-} $resume > /tmp/train.log 2>&1
  rc=$?
  cat /tmp/train.log >> "$OUT/train.log"
  echo "== train $resume rc=$rc $((SECONDS - t)) s"; grep -vE "^step " /tmp/train.log | tail -25
  if [ $rc = 0 ]; then
    (cd "$run" && sha256sum model.safetensors > sha256 && split -b 15M model.safetensors "$OUT/model.safetensors.part-" \
      && tar -czf "$OUT/dm_meta.tar.gz" config.json README.md train_log.json sha256 $(ls loss.png 2>/dev/null))
    ls -la "$OUT"
  fi
  exit $rc
  ;;
esac
