"""Dense SwiGLU MLP and the sparse MoE block (top-k softmax router + optional shared expert).

Sources: transformers' `Qwen3_5MLP`, `Qwen3NextTopKRouter`, `Qwen3NextExperts`,
`Qwen3NextSparseMoeBlock` (modeling_qwen3_next.py; Qwen3.5-MoE is the same with norm_topk_prob
always on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from deltaserve.model.merged import MergedLinear
from deltaserve.ops import fused

if TYPE_CHECKING:
    from deltaserve.model.config import ModelConfig


class MLP(nn.Module):
    """y = down(silu(gate(x)) · up(x)); x [T, hidden] -> [T, hidden].

    gate_proj | up_proj are one `MergedLinear` (`gate_up_proj`, rows [I | I]): one GEMM, then
    `fused.silu_mul` on its output.
    """

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", intermediate),
                                                  ("up_proj", intermediate)])
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused.silu_mul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """E SwiGLU experts stored stacked (the Hub's fused layout; per-expert checkpoints are
    stacked by the loader): gate_up_proj [E, 2I, hidden] (rows [gate (I) | up (I)]),
    down_proj [E, hidden, I].
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor,
                top_weight: torch.Tensor) -> torch.Tensor:
        """x [T, hidden], top_idx [T, k] int64, top_weight [T, k] (x's dtype) -> [T, hidden].

        Loops over the experts hit by this batch (a host sync; not CUDA-graph capturable).
        """
        out = torch.zeros_like(x)
        for e in torch.unique(top_idx).tolist():
            rows, slot = torch.where(top_idx == e)
            gate, up = F.linear(x[rows], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e]) * top_weight[rows, slot, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out


class SparseMoE(nn.Module):
    """Router softmax over E experts (fp32), top-k, optional renormalisation of the k weights,
    weighted sum of the chosen experts, plus sigmoid(shared_expert_gate(x)) · shared_expert(x)
    when the config has a shared expert. x [T, hidden] -> [T, hidden].
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        self.shared_expert_gate: nn.Linear | None = None
        if config.shared_expert_intermediate_size > 0:
            self.shared_expert = MLP(hidden, config.shared_expert_intermediate_size)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        top_weight, top_idx = torch.topk(probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
        out = self.experts(x, top_idx, top_weight.to(logits.dtype))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out
