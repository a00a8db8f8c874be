"""The default model's architecture: a small Qwen3.5-style hybrid (`qwen3_5_text`).

8 decoder layers in the Qwen3.5 pattern of 3 Gated DeltaNet layers per full-attention layer
(layers 3 and 7 are full attention), hidden 384, SwiGLU MLP 1024, one MTP layer; 17.0 M
parameters plus 1.9 M in the MTP head (37.7 MB in bf16). The same config serves the random
stand-in (`build.py`) and the trained model (`scripts/train_default_model.py`). Until
2026-12-06 the shipped model was hidden 256 with 4 / 8 GDN heads (10.5 M + 1.2 M).
"""

from __future__ import annotations

from typing import Any

from transformers import Qwen3_5TextConfig

from deltaserve.default_model.tokenizer import MODEL_MAX_LENGTH, SPECIAL_TOKENS, VOCAB_SIZE

FULL_ATTENTION_INTERVAL = 4  # 3 GDN layers, then one full-attention layer

ARCH: dict[str, Any] = {
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 8,
    # full attention: gated q_proj, q/k RMSNorm, partial RoPE on 64 * 0.25 = 16 dims
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    # Gated DeltaNet: H = 6 key heads, HV = 12 value heads, K = V = 32, conv width 4
    "linear_num_key_heads": 6,
    "linear_num_value_heads": 12,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "rope_theta": 10_000_000.0,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
}


def layer_types(num_layers: int) -> list[str]:
    """Qwen3.5's layer pattern: every FULL_ATTENTION_INTERVAL-th layer is full attention."""
    return [
        "full_attention" if (i + 1) % FULL_ATTENTION_INTERVAL == 0 else "linear_attention"
        for i in range(num_layers)
    ]


def default_text_config(**overrides: Any) -> Qwen3_5TextConfig:
    """The default model's `Qwen3_5TextConfig`; `overrides` replace entries of ARCH.

    EOS is <|endoftext|> (id 0); there is no BOS and no pad id in the model config (a pad id
    would freeze that embedding row during training). Embeddings are tied to the lm_head.
    """
    unknown = set(overrides) - set(ARCH)
    if unknown:
        raise ValueError(f"unknown architecture overrides: {sorted(unknown)}")
    arch = {**ARCH, **overrides}
    rope = {
        "rope_type": "default",
        "rope_theta": arch.pop("rope_theta"),
        "partial_rotary_factor": arch.pop("partial_rotary_factor"),
    }
    return Qwen3_5TextConfig(
        **arch,
        vocab_size=VOCAB_SIZE,
        layer_types=layer_types(arch["num_hidden_layers"]),
        rope_parameters=rope,
        max_position_embeddings=MODEL_MAX_LENGTH,
        tie_word_embeddings=True,
        eos_token_id=SPECIAL_TOKENS.index("<|endoftext|>"),
        bos_token_id=None,
        pad_token_id=None,
        mtp_num_hidden_layers=1,
        dtype="bfloat16",
    )
