"""The checkpoint's multi-token-prediction (MTP) head, used as the draft model.

Draft for position i+2 from the target's final hidden h_i and the next token t_{i+1}:
    x = fc(concat[norm_e(embed(t_{i+1})), norm_h(h_i)])  ->  decoder layer  ->  norm
then the target's lm_head. Keys: mtp.fc, mtp.pre_fc_norm_embedding, mtp.pre_fc_norm_hidden,
mtp.layers.{step}.* (one full-attention decoder layer per MTP step), mtp.norm. Embedding and
lm_head are shared with the target (Qwen3-Next / Qwen3.5 MTP as served by vLLM and SGLang).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.config import FULL_ATTENTION
from deltaserve.model.layers import DecoderLayer
from deltaserve.model.merged import Linear
from deltaserve.model.norm import RMSNorm

if TYPE_CHECKING:
    from deltaserve.core import ForwardContext
    from deltaserve.model.config import ModelConfig
    from deltaserve.model.rope import RotaryEmbedding


class MTPHead(nn.Module):
    """MTP layers 0..n-1; step s uses `layers[s % n]`, whose attention layer_id is
    num_hidden_layers + (s % n) (distinct from every target layer, see `config.mtp_layer_ids`).

    `embed_tokens` and `rotary` are the target's modules, held by reference (not registered
    here, so they appear once in the state dict, under the target).
    """

    def __init__(self, config: ModelConfig, num_layers: int, embed_tokens: nn.Embedding,
                 rotary: RotaryEmbedding) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.num_layers = num_layers
        self.fc = Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps)
        base = config.num_hidden_layers
        self.layers = nn.ModuleList(
            DecoderLayer(config, FULL_ATTENTION, attn_layer_id=base + i, gdn_id=None,
                         mlp_index=base + i)
            for i in range(num_layers))
        self.norm = RMSNorm(hidden, eps)
        self.share(embed_tokens, rotary)

    def share(self, embed_tokens: nn.Module, rotary: RotaryEmbedding) -> None:
        """Hold the target's embedding and RoPE (again after tensor-parallel sharding swaps
        the embedding for its vocab-parallel form)."""
        self._shared = (embed_tokens, rotary)  # a tuple: not registered as submodules

    def forward(self, input_ids: torch.Tensor, hidden: torch.Tensor, ctx: ForwardContext,
                step: int = 0) -> torch.Tensor:
        """input_ids [T] int64 (t_{i+1}), hidden [T, hidden] (target's h_i, after its final norm)
        -> [T, hidden] after mtp.norm; feed to `Model.compute_logits`, or back in as `hidden`
        for the next step. ctx.positions [T] are the rows' positions; attention runs on layer_id
        num_hidden_layers + step % num_layers (its own KV).
        """
        embed_tokens, rotary = self._shared
        e = self.pre_fc_norm_embedding(embed_tokens(input_ids))
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))
        cos, sin = rotary(ctx.positions, x.dtype)
        x, residual = self.layers[step % self.num_layers](x, None, cos, sin, ctx)
        return self.norm.add(x, residual)[0]
