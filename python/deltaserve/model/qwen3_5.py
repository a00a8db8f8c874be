"""The hybrid GDN + gated-attention causal LM: Qwen3.5 / Qwen3.6 (dense and MoE), Qwen3-Next.

One class covers every supported model type; differences are in the config (MoE or dense MLPs)
and in the loader (Qwen3-Next's fused GDN projections are reordered at load time).
Source: transformers' `Qwen3_5TextModel` / `Qwen3NextModel` and their `*ForCausalLM`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.layers import DecoderLayer
from deltaserve.model.merged import Linear
from deltaserve.model.mtp import MTPHead
from deltaserve.model.norm import RMSNorm
from deltaserve.model.rope import RotaryEmbedding
from deltaserve.ops.linear import linear

if TYPE_CHECKING:
    from deltaserve.core import ForwardContext
    from deltaserve.model.config import ModelConfig
    from deltaserve.model.gdn import GatedDeltaNet


class Model(nn.Module):
    """embed -> decoder layers -> final norm; `compute_logits` applies the (maybe tied) lm_head.

    Parameter names follow the checkpoint's after the `model.` / `model.language_model.` prefix
    is dropped (`layers.3.self_attn.q_proj.weight`, `lm_head.weight`, `mtp.fc.weight`), except
    `layers.N.linear_attn.conv_weight` [D, W] (checkpoint: `conv1d.weight` [D, 1, W]) and the
    stacked `mlp.experts.gate_up_proj` / `down_proj`.
    """

    def __init__(self, config: ModelConfig, num_mtp_layers: int | None = None) -> None:
        """num_mtp_layers: MTP layers to build (default: config.mtp_num_hidden_layers; 0: none)."""
        super().__init__()
        self._config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, kind, attn_layer_id=i, gdn_id=config.gdn_index.get(i),
                         mlp_index=i)
            for i, kind in enumerate(config.layer_types))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.rotary_dim, config.rope_theta)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        if num_mtp_layers is None:
            num_mtp_layers = config.mtp_num_hidden_layers
        self.mtp: MTPHead | None = None
        # tensor parallel (distributed/shard.py): logits shard [T, V/tp] -> [T, V]
        self.vocab_gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        if num_mtp_layers > 0:
            self.mtp = MTPHead(config, num_mtp_layers, self.embed_tokens, self.rotary)

    @property
    def config(self) -> ModelConfig:
        return self._config

    def shard_config(self, local: ModelConfig) -> None:
        """After tensor-parallel sharding (distributed/shard.py): `config` reports this rank's
        head counts and intermediate sizes, which the caches are sized from."""
        self._config = local

    @property
    def gdn_layers(self) -> list[GatedDeltaNet]:
        """The GDN token mixers in gdn_id order (what the GDN backend reads dims from)."""
        return [layer.linear_attn for layer in self.layers if layer.is_gdn]

    @property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """The target's full-attention layer_ids (MTP layers: `config.mtp_layer_ids`)."""
        return self._config.attention_layer_ids

    @property
    def num_gdn_layers(self) -> int:
        return self._config.num_gdn_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids [T] int64, ctx.positions [T] int64 -> hidden [T, hidden] (model dtype),
        after the final norm. Calls ctx.hidden_sink(hidden) with that tensor when set.
        Attention layer i calls ctx.attn.forward(i, ...); GDN layers call ctx.gdn.forward.
        """
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(ctx.positions, x.dtype)
        residual = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos, sin, ctx)
        hidden = self.norm(x) if residual is None else self.norm.add(x, residual)[0]
        if ctx.hidden_sink is not None:
            ctx.hidden_sink(hidden)
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, hidden] -> logits [T, vocab] fp32 (matmul in the model dtype, then cast)."""
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        logits = linear(hidden, weight).float()
        return logits if self.vocab_gather is None else self.vocab_gather(logits)
