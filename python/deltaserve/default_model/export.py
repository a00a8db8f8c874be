"""Write a trained default model as a Hugging Face folder, its model card and loss curve."""

from __future__ import annotations

import copy
import os
import shlex
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve.default_model.build import TOKENIZER_FILES
from deltaserve.default_model.corpus import LICENSE
from deltaserve.default_model.training import TrainModel


def save_hf_folder(model: TrainModel, out_dir: str | os.PathLike, tokenizer_dir: str) -> int:
    """Save config.json, model.safetensors (bf16, with mtp.* keys) and the tokenizer files.

    Returns the safetensors file size in bytes. Does not modify `model` (saves copies).
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    copy.deepcopy(model.lm).to("cpu", torch.bfloat16).save_pretrained(out)
    path = out / "model.safetensors"
    tensors = load_file(path)
    mtp_state = model.mtp.state_dict()
    tensors.update({f"mtp.{k}": v.detach().to("cpu", torch.bfloat16) for k, v in mtp_state.items()})
    save_file(dict(sorted(tensors.items())), path, metadata={"format": "pt"})
    path.chmod(0o644)
    for name in TOKENIZER_FILES:
        shutil.copyfile(Path(tokenizer_dir) / name, out / name)
    return path.stat().st_size


# flags that split a run over device calls; a run stopped and resumed saves the weights of one
# never stopped (tested), so the card's command leaves them out
_CALL_FLAGS = {"--stop-minutes": 1, "--final-seconds": 1, "--stop-step": 1, "--resume": 0}


def run_command(command: str) -> str:
    """`command` without the flags that only split the run over calls (_CALL_FLAGS)."""
    words, out = shlex.split(command), []
    i = 0
    while i < len(words):
        flag = words[i].split("=", 1)[0]
        if flag in _CALL_FLAGS:
            i += 1 + (_CALL_FLAGS[flag] if "=" not in words[i] else 0)
            continue
        out.append(words[i])
        i += 1
    return shlex.join(out)


def extra_corpus_text(corpus: dict) -> str:
    """The model card's paragraph on the extra training split: every package, its version and
    license (grouped by license), sizes and what was dropped; "" without one."""
    extra, split = corpus.get("extra"), corpus["splits"].get("extra")
    if not extra or not split:
        return ""
    by_license: dict[str, list[str]] = {}
    for pkg in extra["packages"].values():
        by_license.setdefault(pkg["license"], []).append(f"{pkg['dist']} {pkg['version']}")
    groups = "; ".join(f"{lic}: {', '.join(sorted(names, key=str.lower))}"
                       for lic, names in sorted(by_license.items()))
    dropped = ", ".join(f"{n} {why.replace('_', ' ')}" for why, n in extra["dropped"].items())
    return (f"\n\nAlso in training: the `*.py` files of {len(extra['packages'])} permissively "
            f"licensed packages ({split['n_files']} files / {split['n_bytes'] / 1e6:.1f} MB, "
            f"SHA-256 `{extra['sha256']}`; files dropped: {dropped}), each under its own "
            f"license as its metadata states: {groups}.")


def model_card(info: dict) -> str:
    """README.md text: corpus, license, size, training command and held-out results.

    info keys: corpus (manifest), params (model, mtp), size_bytes, command, steps, tokens,
    seconds, device, final (evaluate() result), config (the architecture summary), curve (a
    sentence naming the loss plot and log files).
    """
    c, f, p = info["corpus"], info["final"], info["params"]
    train, held = c["splits"]["train"], c["splits"]["heldout"]
    mtp = ", ".join(f"step {i + 1}: {x:.3f}" for i, x in enumerate(f["mtp_loss"]))
    return f"""---
license: apache-2.0
library_name: transformers
tags: [qwen3_5_text, gated-deltanet, hybrid, mtp, deltaserve]
---
# deltaserve default model

A small Qwen3.5-style hybrid language model (`qwen3_5_text`): {info["config"]}.
It is deltaserve's built-in default model, trained from scratch on Python source code.
It completes Python code; it is not an assistant and knows nothing beyond the corpus.

- Parameters: {p["model"] / 1e6:.2f} M (embeddings tied to the lm_head) + {p["mtp"] / 1e6:.2f} M
  in the MTP head; {info["size_bytes"] / 1e6:.1f} MB of bf16 safetensors.
- Tokenizer: byte-level BPE, vocabulary 8192 (`tokenizers`), ChatML chat template;
  EOS `<|endoftext|>` (id 0), which also separates the training documents.

## Corpus and license
The Python {c["python_version"]} standard library source and its tests (`*.py`, UTF-8),
{train["n_files"]} files / {train["n_bytes"] / 1e6:.1f} MB for training and {held["n_files"]}
files / {held["n_bytes"] / 1e6:.2f} MB held out (by a hash of the file path,
{c["held_out_per_10k"] / 100:g}%). Corpus SHA-256 `{c["sha256"]}`.
The standard library is licensed under the {LICENSE}.{extra_corpus_text(c)}
These weights are released under Apache-2.0.

## Training
{info["steps"]} steps, {info["tokens"] / 1e6:.1f} M tokens, {info["seconds"] / 60:.1f} min on
{info["device"]}; next-token cross-entropy plus MTP cross-entropy (the MTP head predicts token
i+2 from embed(t_(i+1)) and the final hidden state h_i, and recursively beyond). Command:

    {run_command(info["command"])}

## Held-out results ({f["tokens"]} tokens)
- next-token loss {f["loss"]:.4f} nats/token, perplexity {f["ppl"]:.2f}
- MTP loss: {mtp}
- first MTP draft agrees with the model's own greedy token {100 * f["draft1_agreement"]:.1f}%
  of the time (teacher-forced)

{info["curve"]}
"""


def plot_losses(log: dict, path: str | os.PathLike) -> bool:
    """Save the training/held-out loss curve as a PNG; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = [r["step"] for r in log["train"]]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    ax.plot(steps, [r["main"] for r in log["train"]], lw=0.8, label="train next-token")
    if log["train"] and log["train"][0]["mtp"]:
        ax.plot(steps, [r["mtp"][0] for r in log["train"]], lw=0.8, label="train MTP step 1")
    if log["eval"]:
        ev = log["eval"]
        ax.plot([e["step"] for e in ev], [e["loss"] for e in ev], "o-", label="held-out next-token")
        ax.plot([e["step"] for e in ev], [e["mtp_loss"][0] for e in ev], "s--",
                label="held-out MTP step 1")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title("deltaserve default model")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True
