"""The sparse MoE block's ops: routing, expert compute and the weighted combine, in torch.

Decode-sized batches in bf16 / fp16 on the GPU (up to 256 tokens) do not come here: they take
the extension's kernels (ops/moe_fused.py, docs/kernels.md "MoE decode"). This module serves
long prefills, fp32 and the CPU. Three forms of the expert compute, the same math:
- `experts_reference`: a Python loop over the experts this batch hits (transformers'
  `Qwen3_5MoeExperts.forward`, same rounding points). It syncs with the host (the hit list and
  one `where` per expert) and has data-dependent shapes: the CPU path and the oracle.
- `experts_grouped`: static shapes, no host sync, CUDA-graph safe. The T·k (token, slot) pairs
  are sorted by expert (`argsort`, stable), the per-expert row ranges found on the device
  (`searchsorted` over the sorted ids), and the two expert GEMMs run as grouped GEMMs over the
  stacked weights (`torch._grouped_mm`, one group per expert, device offsets): each selected
  expert's weights are read once per step whatever the batch size, and unselected experts
  (empty groups) are not read at all. The combine un-sorts the rows and reduces the k expert
  outputs per token with the routing weights and, when given, the shared expert's output
  times its sigmoid gate, in one batched GEMM (fp32 accumulation, one rounding).
- `experts_gathered`: static shapes, no host sync, for few rows on any device: the selected
  experts' weight slices are gathered per (token, slot) pair and applied as batched GEMVs.
  The graph-safe decode path where neither the kernels nor the grouped GEMM run (fp32).

`torch._grouped_mm` runs without a host sync only on its CUTLASS path: CUDA (not ROCm), bf16,
compute capability 9.x or 10.x (`_grouped_mm_cuda` in aten/src/ATen/native/cuda/GroupedBlas.cpp,
read in torch 2.10 and in pytorch main; every other case is `_grouped_mm_fallback`, which
copies the offsets to the host). `grouped_is_graph_safe` says when; `moe_experts` picks the
grouped form then, the gathered form for few rows on other GPUs, and the reference loop
otherwise. On CPU torch 2.14 has a grouped-mm kernel (any float dtype), which is what the CPU
tests of the grouped form run.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from deltaserve.ops.fused import silu_mul


def route(logits: torch.Tensor, top_k: int,
          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k softmax router: logits [T, E] (the router GEMM's output, activation dtype) ->
    (top_weight [T, k] in logits' dtype, top_idx [T, k] int64). Static shapes, no host sync.

    On CPU (and without renormalisation) exactly transformers' `Qwen3_5MoeTopKRouter` /
    `Qwen3NextTopKRouter`: softmax over all E experts in fp32, `torch.topk` on the
    probabilities (ties: the experts transformers picks, being the same call), then, when
    `norm_topk_prob`, the k weights divided by their sum in fp32, cast once. On CUDA with
    `norm_topk_prob`: the same value in three kernels instead of six, since the renormalised
    top-k of a softmax is the softmax of the top-k logits (softmax is monotonic: the same
    experts, ties included; weights equal up to fp32 rounding). Raises ValueError when top_k
    is not in 1..E.
    """
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k must be in 1..{logits.shape[-1]} (the number of experts), "
                         f"got {top_k}")
    if norm_topk_prob and logits.is_cuda:
        return route_topk_first(logits, top_k)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    top_weight, top_idx = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        top_weight = top_weight / top_weight.sum(dim=-1, keepdim=True)
    return top_weight.to(logits.dtype), top_idx


def route_topk_first(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`route` with renormalisation, top-k first: topk over the logits, softmax (fp32) over
    the k chosen. Shapes and dtypes as `route`."""
    top_logit, top_idx = torch.topk(logits, top_k, dim=-1)
    return torch.softmax(top_logit, dim=-1, dtype=torch.float).to(logits.dtype), top_idx


def check_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """x [T, H], gate_up [E, 2I, H] and down [E, H, I] must fit together (ValueError)."""
    e, two_i, h = gate_up.shape
    if x.dim() != 2 or x.shape[1] != h:
        raise ValueError(f"x must be [T, {h}], got {list(x.shape)}")
    if two_i % 2 or tuple(down.shape) != (e, h, two_i // 2):
        raise ValueError(f"down must be [{e}, {h}, {two_i // 2}] for gate_up "
                         f"{list(gate_up.shape)}, got {list(down.shape)}")


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, top_idx: torch.Tensor,
           top_weight: torch.Tensor, shared: torch.Tensor | None = None,
           shared_gate: torch.Tensor | None = None) -> None:
    if (shared is None) != (shared_gate is None):
        raise ValueError("shared and shared_gate are given together or not at all")
    if shared is not None and (shared.shape != x.shape or shared_gate.shape != (x.shape[0], 1)):
        raise ValueError(f"shared must be {list(x.shape)} and shared_gate [{x.shape[0]}, 1], "
                         f"got {list(shared.shape)} and {list(shared_gate.shape)}")
    check_experts(x, gate_up, down)
    if top_idx.dim() != 2 or top_idx.shape[0] != x.shape[0] or top_idx.dtype != torch.int64:
        raise ValueError(f"top_idx must be [T={x.shape[0]}, k] int64, got "
                         f"{list(top_idx.shape)} {top_idx.dtype}")
    if top_weight.shape != top_idx.shape:
        raise ValueError(f"top_weight must be {list(top_idx.shape)}, got {list(top_weight.shape)}")


def experts_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                      top_idx: torch.Tensor, top_weight: torch.Tensor) -> torch.Tensor:
    """Σ_j top_weight[t, j] · expert_{top_idx[t, j]}(x[t]), looping over the experts hit.

    x [T, H]; gate_up [E, 2I, H] (rows [gate (I) | up (I)]); down [E, H, I]; top_idx [T, k]
    int64; top_weight [T, k] in x's dtype -> [T, H] in x's dtype. expert_e(v) = down_e ·
    (silu(gate_e v) · up_e v). Each expert's weighted output is rounded to x's dtype and
    accumulated with `index_add_` in x's dtype, expert by expert in ascending order
    (transformers' `Qwen3_5MoeExperts.forward`). Syncs with the host: not graph safe.
    """
    _check(x, gate_up, down, top_idx, top_weight)
    out = torch.zeros_like(x)
    for e in torch.unique(top_idx).tolist():
        rows, slot = torch.where(top_idx == e)
        gate, up = F.linear(x[rows], gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[e]) * top_weight[rows, slot, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


class ExpertRows:
    """The (token, slot) pairs of a batch sorted by expert, all device tensors, static shapes.

    order [T·k] int64: flat pair index (t·k + j) of each sorted row; token [T·k] int64: its
    token t; offsets [E] int32: end row of each expert's group (cumulative counts, as
    `torch._grouped_mm` takes them). Built with a stable `sort` (rows of one expert keep token
    order) and `searchsorted`: no host sync, no data-dependent shape.
    """

    __slots__ = ("order", "token", "offsets")

    def __init__(self, top_idx: torch.Tensor, num_experts: int) -> None:
        ids, self.order = torch.sort(top_idx.reshape(-1), stable=True)
        self.token = self.order // top_idx.shape[1]
        bounds = torch.arange(num_experts, device=ids.device, dtype=ids.dtype)
        self.offsets = torch.searchsorted(ids, bounds, right=True, out_int32=True)


def grouped_mm(a: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[r] = w[g(r)] · a[r] for rows r of group g (rows offsets[g-1]..offsets[g]).

    a [M, K] row-major; w [G, N, K] (the checkpoint layout: out features first); offsets [G]
    int32 cumulative row ends -> y [M, N] in a's dtype. One `torch._grouped_mm` call over the
    transposed (column-major) view of w: no copy of the weights.
    """
    return torch._grouped_mm(a, w.transpose(1, 2), offs=offsets)


def experts_grouped(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    top_idx: torch.Tensor, top_weight: torch.Tensor,
                    shared: torch.Tensor | None = None,
                    shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts (and the gated shared expert) as grouped GEMMs with static shapes.

    Shapes and math as `experts_reference`; shared [T, H] (the shared expert's output) and
    shared_gate [T, 1] (its gate logit), both x's dtype or both None, add
    sigmoid(shared_gate) · shared to each token. -> [T, H] in x's dtype.

    Rounding differs from the reference: the gate|up and down GEMMs round to x's dtype as
    there, but the weighted sum over the k experts and the gated shared term is one batched
    GEMM (fp32 accumulation, one rounding) instead of one rounding per expert. No host sync, no
    data-dependent shape: CUDA-graph safe where `grouped_is_graph_safe` holds.
    """
    _check(x, gate_up, down, top_idx, top_weight, shared, shared_gate)
    t, k = top_idx.shape
    rows = ExpertRows(top_idx, gate_up.shape[0])
    act = grouped_mm(x.index_select(0, rows.token), gate_up, rows.offsets)
    y = grouped_mm(silu_mul(act), down, rows.offsets)
    # back to (token, slot) order: row r of y belongs to pair order[r]
    unsorted = torch.empty_like(y).index_copy_(0, rows.order, y)
    return _combine(unsorted.view(t, k, -1), top_weight, shared, shared_gate)


def experts_gathered(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     top_idx: torch.Tensor, top_weight: torch.Tensor,
                     shared: torch.Tensor | None = None,
                     shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """`experts_grouped`'s math for few rows on any device: the selected experts' weights are
    gathered per (token, slot) pair ([T·k, 2I, H] and [T·k, H, I]) and applied as batched
    GEMVs (`torch.bmm`), then combined as there (fp32, one rounding). Static shapes, no host
    sync: the graph-safe decode path where `torch._grouped_mm` would sync (fp16, fp32, ROCm,
    GPUs other than sm90/sm100). Its gathered copies cost T·k expert slices of memory, so
    `moe_experts` takes it only up to GATHER_BYTES (`gather_fits`).
    """
    _check(x, gate_up, down, top_idx, top_weight, shared, shared_gate)
    t, k = top_idx.shape
    flat = top_idx.reshape(-1)
    xs = x.unsqueeze(1).expand(t, k, x.shape[1]).reshape(t * k, x.shape[1], 1)
    act = torch.bmm(gate_up.index_select(0, flat), xs)[..., 0]
    h = torch.bmm(down.index_select(0, flat), silu_mul(act).unsqueeze(-1))
    return _combine(h.view(t, k, -1), top_weight, shared, shared_gate)


def _combine(y: torch.Tensor, top_weight: torch.Tensor, shared: torch.Tensor | None,
             shared_gate: torch.Tensor | None) -> torch.Tensor:
    """y [T, k, H] expert outputs in (token, slot) order -> Σ_j w_j y_j (+ sigmoid(g) · s) in
    one batched GEMM: cuBLAS (and the CPU kernel) accumulate in fp32 and round once; the gated
    shared term, rounded to y's dtype first, enters as the GEMM's addend."""
    w = top_weight.to(y.dtype).unsqueeze(1)
    if shared is None:
        return torch.bmm(w, y)[:, 0]
    return torch.baddbmm((torch.sigmoid(shared_gate) * shared).unsqueeze(1), w, y)[:, 0]


@functools.cache
def _fast_grouped_device(index: int) -> bool:
    major, _ = torch.cuda.get_device_capability(index)
    return major in (9, 10)


def grouped_is_graph_safe(device: torch.device, dtype: torch.dtype) -> bool:
    """True when `experts_grouped` runs on `device` in `dtype` without a host sync: CUDA (not
    ROCm), bf16, compute capability 9.x / 10.x (torch's CUTLASS grouped GEMM; see the module
    docstring). CPU tensors never need a graph, so CPU answers False."""
    if device.type != "cuda" or torch.version.hip is not None or dtype != torch.bfloat16:
        return False
    return _fast_grouped_device(device.index if device.index is not None
                                else torch.cuda.current_device())


GATHER_BYTES = 256 * 2**20  # gathered expert weights one `experts_gathered` call may copy


def gather_fits(rows: int, gate_up: torch.Tensor) -> bool:
    """Whether `experts_gathered` over `rows` (token, slot) pairs stays within GATHER_BYTES
    (gate_up [E, 2I, H]: one pair copies 3·I·H elements)."""
    _, two_i, h = gate_up.shape
    return rows * 3 * (two_i // 2) * h * gate_up.element_size() <= GATHER_BYTES


def experts_graph_safe(device: torch.device, dtype: torch.dtype, rows: int, top_k: int,
                       gate_up: torch.Tensor) -> bool:
    """Whether `moe_experts` runs without a host sync for every batch of up to `rows` tokens
    on `device` in `dtype` (the engine captures CUDA graphs for MoE models only then)."""
    if device.type != "cuda":
        return False
    return grouped_is_graph_safe(device, dtype) or gather_fits(rows * top_k, gate_up)


def moe_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                top_idx: torch.Tensor, top_weight: torch.Tensor,
                shared: torch.Tensor | None = None,
                shared_gate: torch.Tensor | None = None) -> torch.Tensor:
    """The MoE block's expert part, shapes as `experts_grouped`. On CUDA: the grouped form where
    it is graph safe (`grouped_is_graph_safe`), else the gathered form for few rows
    (`gather_fits`); otherwise (CPU, or a long prefill without the grouped kernel) the
    reference loop plus the gated shared expert added in x's dtype (transformers' order:
    experts, then + sigmoid(g) · shared)."""
    if grouped_is_graph_safe(x.device, x.dtype):
        return experts_grouped(x, gate_up, down, top_idx, top_weight, shared, shared_gate)
    if x.is_cuda and gather_fits(top_idx.numel(), gate_up):
        return experts_gathered(x, gate_up, down, top_idx, top_weight, shared, shared_gate)
    out = experts_reference(x, gate_up, down, top_idx, top_weight)
    if shared is not None:
        out = out + torch.sigmoid(shared_gate) * shared
    return out
