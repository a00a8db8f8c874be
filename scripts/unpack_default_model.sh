#!/usr/bin/env bash
# Unpack a default-model training run that came back from the device (benchmarks/
# device_train.sh MODE=train: model.safetensors.part-*, dm_meta.tar.gz) into an HF folder,
# check the weights' sha256, add the shipped tokenizer and generation config, and evaluate it
# on the 20 fixed openings (issue 33's criteria; CPU, a few minutes).
#   bash scripts/unpack_default_model.sh FILES_AT [DEST=build/dm_new]
# Shipping is a separate, deliberate step (docs/default_model.md, "Training"): copy
# config.json, model.safetensors and README.md from DEST into
# python/deltaserve/default_model/files/, train_log.json and loss.png into docs/.
set -euo pipefail
src=${1:?usage: unpack_default_model.sh FILES_AT [DEST]}
dest=${2:-build/dm_new}
files=python/deltaserve/default_model/files
mkdir -p "$dest"
cat "$src"/model.safetensors.part-* > "$dest/model.safetensors"
tar -xzf "$src/dm_meta.tar.gz" -C "$dest"
(cd "$dest" && sha256sum -c sha256)
for f in tokenizer.json tokenizer_config.json generation_config.json; do
  [ -f "$dest/$f" ] || cp "$files/$f" "$dest/"
done
py=${PYTHON:-.venv/bin/python}
"$py" scripts/eval_default_model.py --model "$dest" --token-healing --mtp-k 3 \
  --out "$dest/eval.json" | tail -12 || true
"$py" scripts/eval_default_model.py --model "$dest" --token-healing --repetition-penalty 1.1 \
  --mtp-k 3 --out "$dest/eval_rp11.json" | tail -12 || true
