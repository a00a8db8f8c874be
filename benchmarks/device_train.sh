#!/usr/bin/env bash
# Device-side runs of the default model's training (issue 33); no extension build needed.
# Needs build/corpus.tar.xz carried (scripts/pack_corpus.sh); the encoded corpus, the chosen
# variant and the checkpoint stay in /tmp on the machine between calls.
#   MODE=auto bash benchmarks/device_train.sh     (the same command in each call)
#       first call: with several $VARIANTS (one flag list per line), profile each over 3 steps
#       and keep the fastest (one line: no profile); train with it until the call's time is
#       nearly up (checkpoint, exit 3); later calls resume it (exit 3 again while it is
#       unfinished: run it again within 30 s, before the idle machine is given back).
#       $TRAIN_FLAGS go to every training call. The log grows in OUT/train.log as it runs, and
#       `timeout` sends the trainer SIGTERM (a checkpoint at the next step) before $CALL_S.
#   MODE=stage bash benchmarks/device_train.sh   (carry build/corpus_parts/part-XX, PARTS and
#       SHA256SUMS; one call per part, in PARTS order, on one warm machine)
#       when the corpus with the tree is over the 64 MiB a call carries (scripts/pack_corpus.sh
#       splits it): each call appends its part; the one that completes the SHA-256 unpacks it,
#       and MODE=auto calls then need no corpus carried.
#   MODE=probe VARIANTS=$'--mtp-fraction 0.25\n--compile inductor' bash benchmarks/device_train.sh
#       only the profiles (OUT/probe.log, their op tables; OUT/probe.tsv, tokens/s).
# A finished run leaves in OUT model.safetensors.part-* (files of 15 MB: what comes back) and
# dm_meta.tar.gz (config.json, README.md, train_log.json, loss.png, sha256); unpack them here
# with scripts/unpack_default_model.sh.
set -uo pipefail
source "$(dirname "$0")/device_env.sh"
stage() {  # append the carried parts in PARTS order; unpack once they add up to the corpus
  local name dir=build/corpus_parts
  [ -f $dir/PARTS ] && [ -f $dir/SHA256SUMS ] || { echo "carry $dir/PARTS and SHA256SUMS"; exit 1; }
  while read -r name; do  # earlier calls' parts may still be on the machine, or not
    grep -qx "$name" /tmp/corpus_staged 2>/dev/null && continue  # a repeated call adds nothing
    [ -f "$dir/$name" ] || break  # a later part waits for this one
    cat "$dir/$name" >> /tmp/corpus.tar.xz && echo "$name" >> /tmp/corpus_staged
  done < $dir/PARTS
  [ -f /tmp/corpus_staged ] || { echo "no part staged: carry $(head -1 $dir/PARTS) first"; exit 1; }
  echo "staged $(paste -sd, /tmp/corpus_staged): $(stat -c %s /tmp/corpus.tar.xz) bytes"
  if (cd /tmp && sha256sum -c --status "$OLDPWD/build/corpus_parts/SHA256SUMS"); then
    rm -rf /tmp/corpus_full && mkdir -p /tmp/corpus_full \
      && tar -xJf /tmp/corpus.tar.xz -C /tmp/corpus_full && echo "corpus unpacked" && exit 0
    echo "unpacking failed"; exit 1
  fi
  echo "not complete yet: carry the next part of $(paste -sd, $dir/PARTS)"
}
[ "${MODE:-auto}" = stage ] && { stage; exit 0; }
python3 - <<'PY'
import torch, transformers, triton
print("torch", torch.__version__, "transformers", transformers.__version__, "triton",
      triton.__version__, torch.cuda.get_device_name())
PY
# config.py's architecture (17.0 M + 1.9 M MTP) unless ARCH="--arch KEY=VALUE ..." overrides it
ARCH=${ARCH:-}
CALL_S=${CALL_S:-570}  # this call's time limit, less a margin (the device's is 600 s)
# the fastest of the variants profiled on 2026-12-06 (H100): 694k tokens/s against 261k and 265k
# for `--mtp-fraction 0.25` alone and with `--gdn-solve blocked` (profiler on; that probe took
# 261 s, most of it the cold compile)
VARIANTS=${VARIANTS:-'--mtp-fraction 0.25 --gdn-solve blocked --conv shift --compile inductor'}
FINAL_S=${FINAL_S:-90}  # the final evaluation and save, reserved in the call that ends the run
run=/tmp/dm_run
if [ ! -f /tmp/corpus_full/manifest.json ]; then
  [ -f build/corpus.tar.xz ] || { echo "no corpus: carry build/corpus.tar.xz or stage its parts"; exit 1; }
  mkdir -p /tmp/corpus_full && tar -xJf build/corpus.tar.xz -C /tmp/corpus_full
fi
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
  elif [ "$(grep -c . <<< "$VARIANTS")" = 1 ]; then
    grep . <<< "$VARIANTS" > /tmp/dm_variant
  else
    probe
    [ -s "$OUT/probe.tsv" ] || { echo "no variant ran"; exit 1; }
    sort -rn "$OUT/probe.tsv" | head -1 | cut -f2 > /tmp/dm_variant
  fi
  variant=$(cat /tmp/dm_variant)
  # training time left in this call: start-up (imports, the corpus: 25 s more while it is not
  # encoded yet, the model, the checkpoint) and the checkpoint's save take about 30 s besides
  startup=35; [ -d /tmp/dm_tokens ] || startup=65
  stop=$(python3 -c "print(max(1.0, ($CALL_S - $SECONDS - $startup) / 60))")
  echo "== train [$variant] $resume --stop-minutes $stop --final-seconds $FINAL_S"
  t=$SECONDS
  # shellcheck disable=SC2086  # flag lists
  timeout -s TERM -k 20 $((CALL_S - SECONDS)) python3 scripts/train_default_model.py \
    --out "$run" $COMMON ${TRAIN_FLAGS:-} $variant --stop-minutes "$stop" \
    --final-seconds "$FINAL_S" $resume >> "$OUT/train.log" 2>&1
  rc=$?
  [ $rc = 124 ] && [ -f "$run/checkpoint.pt" ] && rc=3  # stopped by the guard's SIGTERM
  echo "== train rc=$rc $((SECONDS - t)) s"; grep -vE "^step " "$OUT/train.log" | tail -20
  if [ -f "$run/model.safetensors" ]; then  # the run ended (its evaluation may not have)
    (cd "$run" && sha256sum model.safetensors > sha256 \
      && split -b 15M model.safetensors "$OUT/model.safetensors.part-" \
      && tar -czf "$OUT/dm_meta.tar.gz" $(ls config.json README.md train_log.json sha256 \
                                             loss.png 2>/dev/null))
    ls -la "$OUT"
  fi
  exit $rc
  ;;
esac
