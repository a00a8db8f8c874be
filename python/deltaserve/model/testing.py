"""Tiny random checkpoints for tests (model, engine, server): real transformers models, saved
with `save_pretrained` (fp32 safetensors), plus random `mtp.*` tensors (transformers drops them).

    path = make_tiny_checkpoint(tmp_path / "ckpt", "qwen3_5_text")
    model = load_model(path, torch.float32, "cpu")

Dimensions: hidden 64, 4 layers (3 GDN + 1 full attention), 4 query / 2 KV heads of dim 16,
GDN H=2 key heads, HV=4 value heads (grouped value heads), K=V=16, vocab 512, EOS = vocab - 1.
MoE types: 8 experts, top-2, expert width 32, shared expert 48. Weights are re-drawn with larger,
non-degenerate scales (norm weights, A_log, dt_bias included) so logits have real spread.
Building one takes well under a second.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import inspect
import json
import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TINY_MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe", "qwen3_next")

_TEXT = dict(
    vocab_size=512, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
    linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
    max_position_embeddings=4096, rms_norm_eps=1e-6,
)
_DENSE = dict(intermediate_size=128)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
            shared_expert_intermediate_size=48)
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
               num_position_embeddings=16, patch_size=4)


def make_tiny_checkpoint(path: str | Path, model_type: str, seed: int = 0,
                         with_mtp: bool = True, **overrides: Any) -> Path:
    """Write a tiny random checkpoint of config.json model type `model_type` to `path`.

    model_type: one of TINY_MODEL_TYPES (`qwen3_5` / `qwen3_5_moe` include a tiny vision tower and
    nest the text config, like the Hub checkpoints). `overrides` replace text-config fields
    (e.g. tie_word_embeddings=True, num_hidden_layers=8, layer_types=[...]). Deterministic in
    `seed`; the caller's global RNG state is left untouched. MoE experts are saved per expert
    (`mlp.experts.N.gate_proj.weight`), as transformers' save_pretrained writes them.
    Returns `path`.
    """
    from transformers import (  # deferred: transformers is slow to import
        Qwen3_5Config,
        Qwen3_5ForCausalLM,
        Qwen3_5ForConditionalGeneration,
        Qwen3_5MoeConfig,
        Qwen3_5MoeForCausalLM,
        Qwen3_5MoeForConditionalGeneration,
        Qwen3NextConfig,
        Qwen3NextForCausalLM,
    )
    from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5DecoderLayer
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeDecoderLayer
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextDecoderLayer

    if model_type not in TINY_MODEL_TYPES:
        raise ValueError(f"unknown tiny model type {model_type!r}; one of {TINY_MODEL_TYPES}")
    path = Path(path)
    moe = model_type != "qwen3_5_text" and model_type != "qwen3_5"
    text = {**_TEXT, **(_MOE if moe else {}), **_DENSE, "eos_token_id": _TEXT["vocab_size"] - 1}
    if model_type == "qwen3_5_moe_text" or model_type == "qwen3_5_moe":
        text.pop("intermediate_size")
    text.update(overrides)
    if "vocab_size" in overrides and "eos_token_id" not in overrides:
        text["eos_token_id"] = overrides["vocab_size"] - 1
    builders = {
        "qwen3_5_text": (Qwen3_5TextConfig, Qwen3_5ForCausalLM, Qwen3_5DecoderLayer),
        "qwen3_5": (Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5DecoderLayer),
        "qwen3_5_moe_text": (Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM, Qwen3_5MoeDecoderLayer),
        "qwen3_5_moe": (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                        Qwen3_5MoeDecoderLayer),
        "qwen3_next": (Qwen3NextConfig, Qwen3NextForCausalLM, Qwen3NextDecoderLayer),
    }
    config_cls, model_cls, layer_cls = builders[model_type]
    if model_type in ("qwen3_5", "qwen3_5_moe"):
        config = config_cls(text_config=text, vision_config=dict(_VISION),
                            tie_word_embeddings=text.get("tie_word_embeddings", False))
        text_config = config.text_config
    else:
        config = text_config = config_cls(**text)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        randomize_(model)
        mtp = _make_mtp(text_config, layer_cls) if with_mtp else {}
    model.save_pretrained(path)
    if with_mtp:
        _add_tensors(path, mtp, mtp_layers=1)
    return path


_MODELING = ("qwen3_5.modeling_qwen3_5", "qwen3_5_moe.modeling_qwen3_5_moe",
              "qwen3_next.modeling_qwen3_next")
_KERNEL_FUNCS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule",
                 "causal_conv1d_fn", "causal_conv1d_update")


@contextlib.contextmanager
def transformers_torch_kernels() -> Iterator[None]:
    """Within this context transformers' Qwen3.5 / Qwen3-Next modeling runs its pure-torch GDN
    and conv functions.

    transformers binds fla-core's Triton kernels at import time when fla is installed, and those
    cannot run on CPU tensors; the torch reference stays reachable through `inspect.unwrap`. The
    swap is scoped to the context (the modules' globals are restored on exit).
    """
    with contextlib.ExitStack() as stack:
        for name in _MODELING:
            module = importlib.import_module(f"transformers.models.{name}")
            for func in _KERNEL_FUNCS:
                torch_impl = inspect.unwrap(getattr(module, func))
                stack.enter_context(mock.patch.object(module, func, torch_impl))
        yield


def random_tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    """`n` token ids drawn uniformly from [0, vocab) by `random.Random(seed)`: the tests'
    reproducible prompts (below the tiny checkpoints' EOS id, 511)."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]


@torch.no_grad()
def transformers_logits(path: str | Path, input_ids: torch.Tensor) -> torch.Tensor:
    """The oracle: transformers' own model loaded from `path` (fp32, CPU) on one sequence.

    input_ids [T] int64 -> logits [T, vocab] fp32 (positions 0..T-1, no cache).
    """
    from transformers import AutoModelForCausalLM

    with transformers_torch_kernels():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return model(input_ids[None]).logits[0].float()


@torch.no_grad()
def transformers_greedy(path: str | Path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Greedy continuation by transformers (fp32, CPU, full recompute per token): the token ids
    the engine must reproduce exactly (check near ties separately)."""
    from transformers import AutoModelForCausalLM

    with transformers_torch_kernels():
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        ids = list(prompt_ids)
        for _ in range(max_new_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1]
            ids.append(int(logits.argmax()))
    return ids[len(prompt_ids):]


def randomize_(module: nn.Module) -> None:
    """Re-draw every parameter of a transformers Qwen3.5 / Qwen3-Next module in place, from the
    global RNG, at scales that keep activations O(1) and make every component matter:
    zero-centred norms ~ U(-0.3, 0.3); gated norms ~ 1 + U(-0.3, 0.3); A = U(0.05, 2) (slow and
    fast decays); dt_bias ~ N(0, 0.5); matrices ~ N(0, 1/fan_in), lm_head 4x that (logits std ~2);
    embeddings ~ N(0, 1).
    """
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.05, 2.0).log())
            elif name.endswith("dt_bias"):
                p.normal_(0.0, 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + torch.empty_like(p).uniform_(-0.3, 0.3))
            elif p.ndim == 1 and name.endswith("norm.weight"):
                p.uniform_(-0.3, 0.3)
            elif "embed_tokens" in name or "pos_embed" in name:
                p.normal_(0.0, 1.0)
            elif name.endswith("lm_head.weight"):
                p.normal_(0.0, 2.0 / math.sqrt(p.shape[-1]))  # logits std ~2
            elif p.ndim >= 2:
                fan_in = p.shape[-1] if "conv1d" not in name else p.shape[-1] * p.shape[1]
                p.normal_(0.0, 1.0 / math.sqrt(fan_in))
            else:
                p.normal_(0.0, 0.1)


def _make_mtp(text_config, layer_cls) -> dict[str, torch.Tensor]:
    """Random MTP tensors in checkpoint naming: fc, pre-fc norms, one full-attention layer
    (built as transformers' decoder layer at index num_hidden_layers), final norm."""
    ext = copy.deepcopy(text_config)
    n = ext.num_hidden_layers
    ext.layer_types = [*ext.layer_types, "full_attention"]
    ext.num_hidden_layers = n + 1
    layer = layer_cls(ext, n)
    randomize_(layer)
    hidden = text_config.hidden_size
    out = {f"mtp.layers.0.{k}": v for k, v in _per_expert(layer.state_dict()).items()}
    out["mtp.fc.weight"] = torch.randn(hidden, 2 * hidden) / math.sqrt(2 * hidden)
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{name}.weight"] = torch.empty(hidden).uniform_(-0.3, 0.3)
    return {k: v.contiguous() for k, v in out.items()}


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """transformers' in-memory stacked experts -> the per-expert checkpoint keys."""
    out = {}
    for key, value in state.items():
        if key.endswith("experts.gate_up_proj"):
            base, inter = key.removesuffix("gate_up_proj"), value.shape[1] // 2
            for e in range(value.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = value[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = value[e, inter:]
        elif key.endswith("experts.down_proj"):
            base = key.removesuffix("down_proj")
            for e in range(value.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = value[e]
        else:
            out[key] = value
    return out


def _add_tensors(path: Path, extra: dict[str, torch.Tensor], mtp_layers: int) -> None:
    """Append `extra` to the single-file checkpoint and announce the MTP layers in config.json."""
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors.update(extra)
    save_file(tensors, file, metadata={"format": "pt"})
    config_file = path / "config.json"
    raw = json.loads(config_file.read_text())
    (raw["text_config"] if "text_config" in raw else raw)["mtp_num_hidden_layers"] = mtp_layers
    config_file.write_text(json.dumps(raw, indent=2))
