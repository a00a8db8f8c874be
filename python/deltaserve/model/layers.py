"""Building blocks of the hybrid decoder; `DecoderLayer` composes them.

The blocks live in their own files: norm.py (RMSNorm, GatedRMSNorm), rope.py (partial RoPE),
attention.py (GatedAttention), gdn.py (GatedDeltaNet), mlp.py (MLP, SparseMoE).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.attention import GatedAttention
from deltaserve.model.config import LINEAR_ATTENTION
from deltaserve.model.gdn import GatedDeltaNet
from deltaserve.model.mlp import MLP, SparseMoE
from deltaserve.model.norm import GatedRMSNorm, RMSNorm
from deltaserve.model.rope import RotaryEmbedding, apply_rope
from deltaserve.ops.prologue import AddRMSNorm

if TYPE_CHECKING:
    from deltaserve.core import ForwardContext
    from deltaserve.model.config import ModelConfig

__all__ = ["DecoderLayer", "GatedAttention", "GatedDeltaNet", "GatedRMSNorm", "MLP", "RMSNorm",
           "RotaryEmbedding", "SparseMoE", "apply_rope"]


class DecoderLayer(nn.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += mlp(norm(x)), with the residual
    carried between layers so each residual add is fused into the next norm (vLLM's form).

    The mixer is `linear_attn` (GatedDeltaNet) or `self_attn` (GatedAttention); the MLP is dense
    or sparse MoE per `config.is_moe_layer(mlp_index)`. transformers' `Qwen3NextDecoderLayer`.
    """

    def __init__(self, config: ModelConfig, layer_type: str, attn_layer_id: int,
                 gdn_id: int | None, mlp_index: int) -> None:
        super().__init__()
        self.is_gdn = layer_type == LINEAR_ATTENTION
        if self.is_gdn:
            assert gdn_id is not None
            self.linear_attn = GatedDeltaNet(config, gdn_id)
        else:
            self.self_attn = GatedAttention(config, attn_layer_id)
        if config.is_moe_layer(mlp_index):
            self.mlp: nn.Module = SparseMoE(config)
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
                sin: torch.Tensor, ctx: ForwardContext) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden]: the previous layer's MLP output (or, with residual None, the layer's
        input itself); residual [T, hidden]: the stream before x is added. Returns (mlp output,
        residual stream before it is added) [T, hidden]: the block's output is their sum, which
        the next layer's norm (or the final norm, `RMSNorm.add`) forms. Inputs are not modified.
        """
        # Each residual add + norm is left to the projection that reads it (the mixer's first,
        # then gate_up_proj), which runs it inside its kernel where it fits (ops.prologue);
        # the sum is there once that projection ran.
        pre: torch.Tensor | AddRMSNorm
        if residual is None:
            residual, pre = x, self.input_layernorm(x)
        else:
            pre = self.input_layernorm.add_deferred(x, residual)
        if self.is_gdn:
            h = self.linear_attn(pre, ctx)
        else:
            h = self.self_attn(pre, cos, sin, ctx)
        if isinstance(pre, AddRMSNorm):
            residual = pre.sum
        post = self.post_attention_layernorm.add_deferred(h, residual)
        return self.mlp(post), post.sum
