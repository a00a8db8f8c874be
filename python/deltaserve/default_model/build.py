"""Build the random stand-in default model: a Hugging Face folder made deterministically.

The folder holds config.json, generation_config.json, model.safetensors (bf16, including the
`mtp.*` tensors) and the shipped tokenizer files. Weights come from a seeded generator, filled
tensor by tensor in sorted key order with a fixed rule per kind of tensor (not transformers'
own initialisation), so the bytes depend only on the config, the seed and torch's CPU normal
generator. Folders are cached under `$DELTASERVE_CACHE` (or ~/.cache/deltaserve) in
`default-<hash>`, the hash covering everything that determines the bytes; they are written to
a temporary sibling directory and renamed into place, so racing builders never expose a
half-written folder (the loser of the race discards its copy).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from deltaserve.default_model.config import default_text_config

FILES_DIR = Path(__file__).resolve().parent / "files"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
BUILDER_VERSION = 1  # bump when the weight rule below changes
SEED = 0
EMBED_STD = 0.1  # tied embeddings: logits spread ~ sqrt(hidden) * EMBED_STD ~ 1.6
NORM_STD = 0.1  # zero-centred norms get small random offsets so (1 + w) is exercised


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """`cache_dir`, else $DELTASERVE_CACHE, else ~/.cache/deltaserve."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("DELTASERVE_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "deltaserve"


def builder_key() -> str:
    """Hex digest of everything that determines the built folder's bytes."""
    h = hashlib.sha256()
    spec = {
        "builder": BUILDER_VERSION,
        "seed": SEED,
        "torch": torch.__version__.split("+")[0],
        "config": default_text_config().to_dict(),
    }
    h.update(json.dumps(spec, sort_keys=True).encode())
    for name in TOKENIZER_FILES:
        h.update((FILES_DIR / name).read_bytes())
    return h.hexdigest()


def _fill(name: str, t: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A fresh fp32 value for the tensor called `name` with t's shape, drawn from `gen`."""
    shape = t.shape
    if name.endswith("A_log"):  # decay rates A in [0.5, 8]
        return torch.empty(shape).uniform_(0.5, 8.0, generator=gen).log()
    if name.endswith("dt_bias"):
        return 1.0 + 0.1 * torch.randn(shape, generator=gen)
    if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: plain weight, centred on 1
        return 1.0 + NORM_STD * torch.randn(shape, generator=gen)
    if t.dim() == 1:  # zero-centred RMSNorms: x_hat * (1 + w)
        return NORM_STD * torch.randn(shape, generator=gen)
    if name.endswith("embed_tokens.weight"):
        return EMBED_STD * torch.randn(shape, generator=gen)
    if name.endswith("conv1d.weight"):  # [D, 1, W]
        return torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
    return torch.randn(shape, generator=gen) / math.sqrt(shape[1])  # Linear [out, in]


def _random_state(module: torch.nn.Module, gen: torch.Generator, prefix: str = "") -> None:
    """Overwrite every parameter of `module` in sorted name order (tied ones once)."""
    params = dict(module.named_parameters())  # tied parameters appear once
    with torch.no_grad():
        for name in sorted(params):
            params[name].copy_(_fill(prefix + name, params[name], gen))


def write_random_model(folder: str | os.PathLike) -> None:
    """Write the random default model (config, safetensors with mtp.*, tokenizer) to `folder`."""
    # deferred: transformers' Qwen3.5 modelling takes ~4.5 s to import (and fla-core with it,
    # which warns on a machine without Triton), and serving the shipped model never needs it
    from transformers import Qwen3_5ForCausalLM

    from deltaserve.default_model.mtp import MTPHead

    config = default_text_config()
    gen = torch.Generator().manual_seed(SEED)
    model = Qwen3_5ForCausalLM(config)
    _random_state(model, gen)
    mtp = MTPHead(model.config)
    _random_state(mtp, gen, prefix="mtp.")
    model.to(torch.bfloat16).save_pretrained(folder)
    path = Path(folder) / "model.safetensors"
    tensors = load_file(path)
    tensors.update({f"mtp.{k}": v.to(torch.bfloat16) for k, v in mtp.state_dict().items()})
    save_file(dict(sorted(tensors.items())), path, metadata={"format": "pt"})
    for name in TOKENIZER_FILES:
        shutil.copyfile(FILES_DIR / name, Path(folder) / name)
    for f in Path(folder).iterdir():
        f.chmod(0o644)


def random_model_path(cache_dir: str | os.PathLike | None = None) -> str:
    """Path of the cached random default model, building it first if absent.

    Safe against concurrent builders in other processes: each writes a private temporary
    directory and renames it to the final name; whoever renames first wins.
    """
    root = cache_root(cache_dir)
    final = root / f"default-{builder_key()[:16]}"
    if (final / "model.safetensors").is_file():
        return str(final)
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=root))
    try:
        write_random_model(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / "model.safetensors").is_file():  # not a lost race: a real error
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(final)
