"""The tensor-parallel ops the sharded model calls: row-parallel projections (one all-reduce),
a reduced MoE block, and the vocab-parallel embedding / LM-head gather.

Megatron-LM's split (Shoeybi et al. 2019, "Megatron-LM", section 3): a column-parallel
projection (each rank holds some output rows, no communication) feeds a row-parallel one (each
rank holds the matching input columns; the partial outputs are summed by one all-reduce).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.ops.linear import linear

if TYPE_CHECKING:
    from deltaserve.distributed.group import TPGroup


class RowParallelLinear(nn.Module):
    """y = all_reduce(x W_rᵀ) + b: W_r [out, in / tp] this rank's input columns, b [out]
    (replicated, added once after the sum). x [T, in / tp] -> y [T, out], equal on every rank.
    Replaces o_proj / out_proj / down_proj of a sharded layer."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class ReducedOutput(nn.Module):
    """inner(x) summed over the ranks: a MoE block whose experts and shared expert are split
    within each expert (TP within experts), so its output is one partial sum per rank and one
    all-reduce serves the routed and the shared experts together."""

    def __init__(self, inner: nn.Module, group: TPGroup) -> None:
        super().__init__()
        self.inner, self.group = inner, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.group.all_reduce(self.inner(x).contiguous())


class VocabParallelEmbedding(nn.Module):
    """Rank r holds vocabulary rows [r·n, (r+1)·n), n = ceil(vocab / tp) (the last rank's
    rows past the vocabulary are zero). ids [T] int64 -> [T, hidden]: each rank embeds the ids
    it holds, zero elsewhere, and one all-reduce sums them (exact: one term is non-zero).
    `.weight` [n, hidden] is also the tied LM head's shard."""

    def __init__(self, weight: torch.Tensor, start: int, group: TPGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.contiguous(), requires_grad=False)
        self.start, self.group = start, group

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        held = (local >= 0) & (local < self.weight.shape[0])
        out = F.embedding(torch.where(held, local, 0), self.weight)
        return self.group.all_reduce(out * held.unsqueeze(-1).to(out.dtype))


class VocabGather:
    """logits shard [T, n] (this rank's vocabulary rows) -> [T, vocab] on every rank: one
    all-gather, then the padding columns past the vocabulary dropped (Model.vocab_gather)."""

    def __init__(self, group: TPGroup, vocab_size: int) -> None:
        self.group, self.vocab_size = group, vocab_size

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        return self.group.gather_last_dim(logits)[..., :self.vocab_size]


def vocab_shard(weight: torch.Tensor, rank: int, size: int) -> tuple[torch.Tensor, int]:
    """weight [vocab, hidden] -> (rows [r·n, (r+1)·n) zero-padded to n rows, first row r·n)."""
    vocab = weight.shape[0]
    n = -(-vocab // size)
    start = rank * n
    rows = weight[start:min(start + n, vocab)]
    if rows.shape[0] < n:
        rows = torch.cat([rows, rows.new_zeros(n - rows.shape[0], weight.shape[1])])
    return rows.clone(), start
