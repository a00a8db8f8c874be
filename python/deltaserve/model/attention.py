"""Gated full attention of Qwen3.5 / Qwen3-Next (transformers' `Qwen3_5Attention`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.merged import Linear, MergedLinear
from deltaserve.model.norm import RMSNorm
from deltaserve.ops import fused
from deltaserve.ops.prologue import ProjectionInput, SigmoidGateMul

if TYPE_CHECKING:
    from deltaserve.core import ForwardContext
    from deltaserve.model.config import ModelConfig


class GatedAttention(nn.Module):
    """q_proj emits, per head, [query (D) | gate (D)]; q/k get a zero-centred RMSNorm over the
    head dim, then partial RoPE; the backend attends (softmax scale `scaling` = D^-1/2);
    the output is multiplied by sigmoid(gate) before o_proj.

    q_proj | k_proj | v_proj are one `MergedLinear` (`qkv_proj`, rows [Hq·2D | Hkv·D | Hkv·D]),
    one GEMM. `layer_id` is what the layer passes to `ctx.attn.forward` (the decoder-layer
    index; MTP layers use num_hidden_layers + step).
    """

    def __init__(self, config: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = d = config.head_dim
        self.scaling = d ** -0.5
        hidden, bias = config.hidden_size, config.attention_bias
        self.qkv_proj = MergedLinear(hidden, [("q_proj", self.num_heads * d * 2),
                                              ("k_proj", self.num_kv_heads * d),
                                              ("v_proj", self.num_kv_heads * d)], bias=bias)
        self.o_proj = Linear(self.num_heads * d, hidden, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def forward(self, x: torch.Tensor | ProjectionInput, cos: torch.Tensor, sin: torch.Tensor,
                ctx: ForwardContext) -> torch.Tensor:
        """x [T, hidden] (or the pre-norm qkv_proj makes) -> [T, hidden]; cos/sin
        [T, rotary_dim] from `RotaryEmbedding`."""
        t, d = x.shape[0], self.head_dim
        q_gate, k, v = self.qkv_proj.split(self.qkv_proj(x))
        q_gate = q_gate.view(t, self.num_heads, 2 * d)
        k = k.view(t, self.num_kv_heads, d)
        v = v.view(t, self.num_kv_heads, d)
        q, k = fused.qk_norm_rope(q_gate, k, self.q_norm.rms_weight, self.k_norm.rms_weight,
                                  cos, sin, self.q_norm.eps)
        o = ctx.attn.forward(self.layer_id, q, k, v)
        return self.o_proj(SigmoidGateMul(o, q_gate))  # the gate runs in o_proj's kernel
