"""Dense SwiGLU MLP and the sparse MoE block (top-k softmax router + optional shared expert).

Sources: transformers' `Qwen3_5MLP`, `Qwen3NextTopKRouter`, `Qwen3NextExperts`,
`Qwen3NextSparseMoeBlock` (modeling_qwen3_next.py; Qwen3.5-MoE is the same with norm_topk_prob
always on).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from deltaserve.model.merged import Linear, MergedLinear
from deltaserve.ops.moe import experts_graph_safe, moe_experts, route
from deltaserve.ops.moe_fused import fused_fits, fused_supported, moe_fused
from deltaserve.ops.prologue import ProjectionInput, SiluMul, as_tensor

if TYPE_CHECKING:
    from deltaserve.model.config import ModelConfig


class MLP(nn.Module):
    """y = down(silu(gate(x)) · up(x)); x [T, hidden] -> [T, hidden].

    gate_proj | up_proj are one `MergedLinear` (`gate_up_proj`, rows [I | I]): one GEMM, then
    `fused.silu_mul` on its output, run by down_proj's kernel where it fits (`ops.prologue`).
    x may be a `ops.prologue.ProjectionInput` (the block's pre-norm, made by gate_up_proj).
    """

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(hidden, [("gate_proj", intermediate),
                                                  ("up_proj", intermediate)])
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor | ProjectionInput) -> torch.Tensor:
        return self.down_proj(SiluMul(self.gate_up_proj(x)))


class Experts(nn.Module):
    """E SwiGLU experts stored stacked (the Hub's fused layout; per-expert checkpoints are
    stacked by the loader): gate_up_proj [E, 2I, hidden] (rows [gate (I) | up (I)]),
    down_proj [E, hidden, I]. The compute is `ops.moe.moe_experts`.
    """

    def __init__(self, num_experts: int, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.gate_up_proj = nn.Parameter(torch.zeros(num_experts, 2 * intermediate, hidden))
        self.down_proj = nn.Parameter(torch.zeros(num_experts, hidden, intermediate))

    def forward(self, x: torch.Tensor, top_idx: torch.Tensor, top_weight: torch.Tensor,
                shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, hidden], top_idx [T, k] int64, top_weight [T, k] (x's dtype), optional shared
        expert output [T, hidden] and its gate logit [T, 1] -> [T, hidden] (x's dtype).

        Grouped GEMMs with static shapes (no host sync, CUDA-graph safe) where
        `ops.moe.grouped_is_graph_safe` holds, gathered batched GEMVs (also sync-free) for few
        rows on other GPUs, the reference loop (host syncs) on CPU and for long prefills there.
        """
        return moe_experts(x, self.gate_up_proj, self.down_proj, top_idx, top_weight,
                           shared, shared_gate)


class SparseMoE(nn.Module):
    """Router softmax over E experts (fp32), top-k, optional renormalisation of the k weights,
    weighted sum of the chosen experts, plus sigmoid(shared_expert_gate(x)) · shared_expert(x)
    when the config has a shared expert. x [T, hidden] -> [T, hidden].

    The router and the shared expert's gate are one `MergedLinear` (`router`, rows [gate (E) |
    shared_expert_gate (1)]): one GEMM gives both. Where `ops.moe_fused.fused_fits` holds
    (CUDA, bf16 / fp16, up to FUSED_MAX_TOKENS tokens: decode and verify steps) the rest is
    `moe_fused`: routing, expert GEMMs, the shared expert and the combine in three kernels.
    Elsewhere: `route`, the shared expert's MLP, and `Experts` (grouped GEMMs on the GPU, the
    transformers-exact reference loop on CPU).
    """

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        shared = config.shared_expert_intermediate_size > 0
        self.router = MergedLinear(hidden, [("gate", config.num_experts)]
                                   + ([("shared_expert_gate", 1)] if shared else []))
        self.experts = Experts(config.num_experts, hidden, config.moe_intermediate_size)
        self.shared_expert: MLP | None = None
        if shared:
            self.shared_expert = MLP(hidden, config.shared_expert_intermediate_size)

    def _shared_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if self.shared_expert is None:
            return None, None
        return self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight

    def forward(self, x: torch.Tensor | ProjectionInput) -> torch.Tensor:
        x = as_tensor(x)  # the router, the experts and the shared expert all read it
        logits = self.router(x)  # [T, E (+1: the shared expert's gate)]
        ex = self.experts
        shared_gate_up, shared_down = self._shared_weights()
        if fused_fits(x, logits, ex.gate_up_proj, ex.down_proj, self.top_k, shared_gate_up,
                      shared_down):
            return moe_fused(x, logits, ex.gate_up_proj, ex.down_proj, self.top_k,
                             self.norm_topk_prob, shared_gate_up, shared_down)
        e = ex.num_experts
        top_weight, top_idx = route(logits[:, :e], self.top_k, self.norm_topk_prob)
        shared = shared_gate = None
        if self.shared_expert is not None:
            shared, shared_gate = self.shared_expert(x), logits[:, e:]
        return ex(x, top_idx, top_weight, shared, shared_gate)


def moe_graph_safe(model: nn.Module, rows: int) -> bool:
    """True when no SparseMoE block of `model` (MTP layers included; a dense model has none)
    syncs with the host on batches of up to `rows` tokens: `ops.moe_fused.fused_supported`
    (the extension's kernels) or `ops.moe.experts_graph_safe` (grouped / gathered GEMMs). The
    engine captures CUDA graphs for MoE models only then."""
    def safe(m: SparseMoE) -> bool:
        gate_up = m.experts.gate_up_proj
        shared_gate_up, _ = m._shared_weights()
        return (fused_supported(gate_up.device, gate_up.dtype, rows, m.top_k, gate_up,
                                shared_gate_up)
                or experts_graph_safe(gate_up.device, gate_up.dtype, rows, m.top_k, gate_up))

    return all(safe(m) for m in model.modules() if isinstance(m, SparseMoE))
