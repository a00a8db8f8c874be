"""Shard a loaded Model in place for tensor parallelism: the one model definition, with each
rank keeping its slice of every weight and the row-parallel projections replaced by the ops of
distributed/layers.py (no second model class).

What each rank holds (r = rank, tp = size):
- attention: query heads [r·Hq/tp, ...) and their KV heads (split when Hkv >= tp, else the one
  KV head of the rank's query heads, replicated over tp / Hkv ranks); q/k/v rows of the merged
  qkv_proj and the matching o_proj columns (row-parallel);
- GDN: value heads [r·HV/tp, ...) and the key heads they read (split, or replicated when
  H < tp, as KV heads); those heads' rows of every part of in_proj (q, k, v, z, b, a), conv1d
  channels, A_log, dt_bias; out_proj columns (row-parallel). The engine then sizes the GDN state
  pool, snapshots, host bank and verify stashes from the local head counts;
- MLP: gate and up rows [r·I/tp, ...) of gate_up_proj, down_proj columns (row-parallel);
- MoE: TP within experts: every expert's gate/up rows and down columns, the shared expert's
  the same; the router and the shared-expert gate replicated; one all-reduce after the block;
- embedding and LM head: vocabulary rows [r·n, (r+1)·n), n = ceil(V/tp), logits gathered;
- norms, MTP fc and its pre-fc norms: replicated.
Source of the split: Megatron-LM (Shoeybi et al. 2019); vLLM's QKVParallelLinear replicates
KV heads when they are fewer than the ranks, as here.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import nn

from deltaserve.distributed.layers import (
    ReducedOutput,
    RowParallelLinear,
    VocabGather,
    VocabParallelEmbedding,
    vocab_shard,
)
from deltaserve.model.attention import GatedAttention
from deltaserve.model.gdn import GatedDeltaNet
from deltaserve.model.merged import Linear, MergedLinear
from deltaserve.model.mlp import MLP, SparseMoE

if TYPE_CHECKING:
    from deltaserve.distributed.group import TPGroup
    from deltaserve.model.config import ModelConfig
    from deltaserve.model.qwen3_5 import Model


class HeadSplit(NamedTuple):
    """One rank's heads: query (or GDN value) heads [q_start, q_start + q_heads), key/value
    (or GDN key) heads [kv_start, kv_start + kv_heads)."""

    q_start: int
    q_heads: int
    kv_start: int
    kv_heads: int


def split_heads(n_q: int, n_kv: int, size: int, rank: int, what: str) -> HeadSplit:
    """Heads of rank `rank` of `size` for n_q grouped heads over n_kv shared heads (query head
    j reads shared head j // (n_q / n_kv)). Raises ValueError naming `what` when n_q is not a
    multiple of size, or n_kv neither a multiple nor a divisor of size."""
    if n_q % n_kv:
        raise ValueError(f"{what}: {n_q} heads are not a multiple of {n_kv} shared heads")
    if n_q % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide the {n_q} {what} heads")
    q = n_q // size
    if n_kv >= size:
        if n_kv % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide the {n_kv} shared "
                             f"heads of {what}")
        kv = n_kv // size
        return HeadSplit(rank * q, q, rank * kv, kv)
    if size % n_kv:
        raise ValueError(f"the {n_kv} shared heads of {what} cannot be replicated evenly over "
                         f"{size} ranks")
    return HeadSplit(rank * q, q, rank // (size // n_kv), 1)


def _split_even(n: int, size: int, rank: int, what: str) -> tuple[int, int]:
    if n % size:
        raise ValueError(f"tensor_parallel_size {size} does not divide {what} {n}")
    return rank * (n // size), n // size


def _narrow_merged(merged: MergedLinear, ranges: dict[str, list[tuple[int, int]]]) -> None:
    """Keep, of each part, the rows (start, count) listed (relative to the part), in order."""
    full = merged.row_ranges()
    parts, weights, biases = [], [], []
    for name, _ in merged.parts:
        base = full[name][0]
        rows = [base + s + i for s, n in ranges[name] for i in range(n)]
        parts.append((name, len(rows)))
        idx = torch.tensor(rows, device=merged.weight.device)
        weights.append(merged.weight.index_select(0, idx))
        if merged.bias is not None:
            biases.append(merged.bias.index_select(0, idx))
    merged.parts = tuple(parts)
    merged.sizes = [rows for _, rows in parts]
    merged.weight = nn.Parameter(torch.cat(weights), requires_grad=False)
    if merged.bias is not None:
        merged.bias = nn.Parameter(torch.cat(biases), requires_grad=False)


def _row_parallel(linear: nn.Linear, start: int, count: int, group: TPGroup) -> RowParallelLinear:
    return RowParallelLinear(linear.weight[:, start:start + count], linear.bias, group)


def _shard_attention(attn: GatedAttention, split: HeadSplit, group: TPGroup) -> None:
    d = attn.head_dim
    _narrow_merged(attn.qkv_proj, {"q_proj": [(split.q_start * 2 * d, split.q_heads * 2 * d)],
                                   "k_proj": [(split.kv_start * d, split.kv_heads * d)],
                                   "v_proj": [(split.kv_start * d, split.kv_heads * d)]})
    attn.o_proj = _row_parallel(attn.o_proj, split.q_start * d, split.q_heads * d, group)
    attn.num_heads, attn.num_kv_heads = split.q_heads, split.kv_heads


def _shard_gdn(gdn: GatedDeltaNet, split: HeadSplit, group: TPGroup) -> None:
    h, k, v = gdn.num_k_heads, gdn.head_k_dim, gdn.head_v_dim
    qk = (split.kv_start * k, split.kv_heads * k)
    channels = [qk, (h * k + qk[0], qk[1]), (2 * h * k + split.q_start * v, split.q_heads * v)]
    heads = [(split.q_start, split.q_heads)]
    _narrow_merged(gdn.in_proj, {"in_proj_qkv": channels,
                                 "in_proj_z": [(split.q_start * v, split.q_heads * v)],
                                 "in_proj_b": heads, "in_proj_a": heads})
    idx = torch.cat([torch.arange(s, s + n) for s, n in channels]).to(gdn.conv_weight.device)
    gdn.conv_weight = nn.Parameter(gdn.conv_weight.index_select(0, idx), requires_grad=False)
    hv = slice(split.q_start, split.q_start + split.q_heads)
    gdn.A_log = nn.Parameter(gdn.A_log[hv].clone(), requires_grad=False)
    gdn.dt_bias = nn.Parameter(gdn.dt_bias[hv].clone(), requires_grad=False)
    gdn.out_proj = _row_parallel(gdn.out_proj, split.q_start * v, split.q_heads * v, group)
    gdn.num_k_heads, gdn.num_v_heads = split.kv_heads, split.q_heads
    gdn.conv_dim = 2 * split.kv_heads * k + split.q_heads * v


def _shard_mlp_rows(mlp: MLP, group: TPGroup, reduce: bool) -> None:
    inter = mlp.down_proj.in_features
    start, n = _split_even(inter, group.size, group.rank, "the MLP intermediate size")
    _narrow_merged(mlp.gate_up_proj, {"gate_proj": [(start, n)], "up_proj": [(start, n)]})
    if reduce:
        mlp.down_proj = _row_parallel(mlp.down_proj, start, n, group)
    else:  # a partial sum, reduced with the block it belongs to
        w = mlp.down_proj.weight[:, start:start + n].contiguous()
        mlp.down_proj = Linear(n, w.shape[0], bias=False, device=w.device, dtype=w.dtype)
        mlp.down_proj.weight = nn.Parameter(w, requires_grad=False)


def _shard_moe(moe: SparseMoE, group: TPGroup) -> None:
    experts = moe.experts
    inter = experts.down_proj.shape[2]
    start, n = _split_even(inter, group.size, group.rank, "the expert intermediate size")
    gate_up = experts.gate_up_proj
    rows = torch.cat([torch.arange(start, start + n), torch.arange(inter + start,
                                                                   inter + start + n)])
    experts.gate_up_proj = nn.Parameter(gate_up.index_select(1, rows.to(gate_up.device)),
                                        requires_grad=False)
    experts.down_proj = nn.Parameter(experts.down_proj[:, :, start:start + n].contiguous(),
                                     requires_grad=False)
    if moe.shared_expert is not None:
        _shard_mlp_rows(moe.shared_expert, group, reduce=False)


def local_config(config: ModelConfig, size: int, rank: int) -> ModelConfig:
    """The config as one rank's modules see it: head counts and intermediate sizes of its
    shard (what the engine sizes the KV pages, GDN state pool and stashes from); the vocabulary,
    hidden size and layer structure stay whole. Raises ValueError naming what does not split
    over `size` ranks."""
    attn = split_heads(config.num_attention_heads, config.num_key_value_heads, size, rank,
                       "attention")
    gdn = split_heads(config.linear_num_value_heads, config.linear_num_key_heads, size, rank,
                      "GDN value")
    for what in ("intermediate_size", "moe_intermediate_size",
                 "shared_expert_intermediate_size"):
        if getattr(config, what) % size:
            raise ValueError(f"tensor_parallel_size {size} does not divide {what} "
                             f"{getattr(config, what)}")
    return dataclasses.replace(
        config, num_attention_heads=attn.q_heads, num_key_value_heads=attn.kv_heads,
        linear_num_value_heads=gdn.q_heads, linear_num_key_heads=gdn.kv_heads,
        intermediate_size=config.intermediate_size // size,
        moe_intermediate_size=config.moe_intermediate_size // size,
        shared_expert_intermediate_size=config.shared_expert_intermediate_size // size)


def shard_model(model: Model, group: TPGroup) -> None:
    """Cut `model` (loaded whole, prepared) down to rank `group.rank`'s shard in place and
    give it the collectives. Raises ValueError (before changing anything) when a head count or
    intermediate size does not split over `group.size` ranks."""
    config, size, rank = model.config, group.size, group.rank
    local = local_config(config, size, rank)  # validates every split first
    attn = split_heads(config.num_attention_heads, config.num_key_value_heads, size, rank,
                       "attention")
    gdn = split_heads(config.linear_num_value_heads, config.linear_num_key_heads, size, rank,
                      "GDN value")
    with torch.no_grad():
        for module in list(model.modules()):
            if isinstance(module, GatedAttention):
                _shard_attention(module, attn, group)
            elif isinstance(module, GatedDeltaNet):
                _shard_gdn(module, gdn, group)
            elif isinstance(module, SparseMoE):
                _shard_moe(module, group)
        # dense MLPs (not a MoE's shared expert, done above) and the MoE blocks' reduction
        for layer in [*model.layers, *(model.mtp.layers if model.mtp is not None else [])]:
            if isinstance(layer.mlp, MLP):
                _shard_mlp_rows(layer.mlp, group, reduce=True)
            elif isinstance(layer.mlp, SparseMoE):
                layer.mlp = ReducedOutput(layer.mlp, group)
        weight, start = vocab_shard(model.embed_tokens.weight, rank, size)
        model.embed_tokens = VocabParallelEmbedding(weight, start, group)
        if model.lm_head is not None:
            head, _ = vocab_shard(model.lm_head.weight, rank, size)
            model.lm_head.weight = nn.Parameter(head, requires_grad=False)
        if model.mtp is not None:
            model.mtp.share(model.embed_tokens, model.rotary)
    model.vocab_gather = VocabGather(group, config.vocab_size)
    model.shard_config(local)
