"""The MoE block's decode path in the extension's own kernels, with its pure-torch reference.

`moe_fused` takes the router GEMM's output (the E expert logits, then the shared expert's gate
logit as one more column) and returns the block's output in four launches, counting the router
GEMM: `moe_route` (top-k, softmax, the (token, slot) pairs grouped by expert into tiles of 16
rows, in one block: csrc/kernels/moe_route.cuh) and `moe_experts` (gate|up with silu·mul in the
epilogue, then down with the routing weights and the gated shared expert combined in it:
csrc/kernels/moe_experts.cuh). The shared expert runs as one more expert over the token rows.

Why it exists: at decode sizes an expert sees a few rows, so the MoE layer is a stream of the
selected experts' weights (batch 1: 8 experts + the shared one, 57 MB a layer at Qwen3.6-35B-A3B
shapes, 13 µs at copy bandwidth) and its time is the weight read plus the launches.
`torch._grouped_mm`'s CUTLASS tiles are sized for many rows per group, and the grouped path
spends ~10 launches on sorting, gathering and combining. Here each item of work is one tile of
one expert times 8 (gate_up) or 32 (down) output columns over all of K, read once with
tensor-core MMAs, as gemv.cuh does for dense projections.

Contract (x, weights and output in T = bf16 or fp16; fp32 inside):
- routing: experts ranked by logit, ties to the lower index (a stable descending sort); weights
  fp32: softmax of the k chosen logits (norm_topk_prob; equal to renormalising the top-k of the
  full softmax) or the chosen entries of the softmax over all E; shared scale sigmoid(logit).
- per (token, slot) pair on expert e: gate|up = x · gate_up[e]ᵀ with fp32 sums, each rounded to
  T; h = round(round(silu(gate)) · up) (silu_mul's rounding points); y = h · down[e]ᵀ in fp32.
- out[t] = round(Σ_j w[t, j] · y[t, j] + scale[t] · y_shared[t]), the slots in order, fp32.
The reference does the same in torch with other fp32 sum orders, so the two agree to the fp32
sums' error plus, where that moves a value across a rounding point, one ulp of T there. The
kernels' result does not depend on how blocks are scheduled (no float atomics: the combine's
last arriving block sums the slots in order) nor on the other rows of the batch (each row's
arithmetic is its own), so a token gets the same bits alone, in a batch, or in a verify step.
No host synchronisation and static shapes: CUDA-graph safe.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops import _ext
from deltaserve.ops.moe import check_experts

KERNEL_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_MAX_TOKENS = 256  # moe_route's one block (kMaxTokens)
KERNEL_MAX_EXPERTS = 512
KERNEL_MAX_TOP_K = 16
TILE_ROWS = 16


# Read once at import (A/B runs set it before starting the process). Larger batches (prefill)
# take the grouped GEMMs (ops/moe.py), whose tiles suit many rows per expert.
FUSED_MAX_TOKENS = _ext.count_from_env("DS_MOE_FUSED_MAX_TOKENS", KERNEL_MAX_TOKENS,
                                        KERNEL_MAX_TOKENS)


def fused_supported(device: torch.device, dtype: torch.dtype, rows: int, top_k: int,
                    gate_up: torch.Tensor, shared_gate_up: torch.Tensor | None = None) -> bool:
    """Whether every batch of 1..`rows` tokens on `device` in `dtype` runs the kernels (no host
    sync, CUDA-graph safe) for these weights (gate_up [E, 2I, H], shared [2Is, H])."""
    return (device.type == "cuda" and _ext.extension_loaded()
            and _shapes_fit(dtype, rows, top_k, gate_up, shared_gate_up))


def _shapes_fit(dtype: torch.dtype, rows: int, top_k: int, gate_up: torch.Tensor,
                shared_gate_up: torch.Tensor | None) -> bool:
    e, two_i, h = gate_up.shape
    return (dtype in KERNEL_DTYPES and 1 <= rows <= FUSED_MAX_TOKENS
            and e <= KERNEL_MAX_EXPERTS and 1 <= top_k <= min(KERNEL_MAX_TOP_K, e)
            and h % 8 == 0 and two_i % 16 == 0 and two_i > 0
            and (shared_gate_up is None or shared_gate_up.shape[0] % 16 == 0))


def _check(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           top_k: int, shared_gate_up: torch.Tensor | None,
           shared_down: torch.Tensor | None) -> None:
    check_experts(x, gate_up, down)
    e, _, h = gate_up.shape
    if (shared_gate_up is None) != (shared_down is None):
        raise ValueError("shared_gate_up and shared_down are given together or not at all")
    if shared_gate_up is not None:
        si = shared_gate_up.shape[0] // 2
        if (shared_gate_up.dim() != 2 or tuple(shared_gate_up.shape) != (2 * si, h)
                or tuple(shared_down.shape) != (h, si)):
            raise ValueError(f"shared_gate_up must be [2Is, {h}] and shared_down [{h}, Is], got "
                             f"{list(shared_gate_up.shape)} and {list(shared_down.shape)}")
    cols = e + (shared_gate_up is not None)
    if tuple(logits.shape) != (x.shape[0], cols):
        raise ValueError(f"logits must be [T={x.shape[0]}, {cols}] (E expert logits"
                         f"{', then the shared gate' if cols > e else ''}), got "
                         f"{list(logits.shape)}")
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in 1..{e} (the number of experts), got {top_k}")
    dtypes = {t.dtype for t in (x, logits, gate_up, down, shared_gate_up, shared_down)
              if t is not None}
    if len(dtypes) != 1 or not x.is_floating_point():
        raise ValueError(f"x, logits and the weights must share one float dtype, got {dtypes}")


def fused_fits(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, top_k: int, shared_gate_up: torch.Tensor | None,
                 shared_down: torch.Tensor | None) -> bool:
    """Whether `moe_fused` on these arguments (shapes as there, already checked) runs the
    kernels rather than the reference (its docstring lists the conditions)."""
    weights = [t for t in (gate_up, down, shared_gate_up, shared_down) if t is not None]
    return (_shapes_fit(x.dtype, x.shape[0], top_k, gate_up, shared_gate_up)
            and x.stride(1) == 1 and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
            and x.data_ptr() % 16 == 0 and logits.stride(1) == 1
            and all(w.is_contiguous() and w.data_ptr() % 16 == 0 for w in weights)
            and _ext.use_extension(x, logits, *weights))


def moe_fused(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
              top_k: int, norm_topk_prob: bool, shared_gate_up: torch.Tensor | None = None,
              shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """The sparse MoE block after its router GEMM (module docstring for the contract).

    x [T, H]; logits [T, E] (+1 column, the shared expert's gate logit, when the shared expert
    is given); gate_up [E, 2I, H] (rows [gate | up]); down [E, H, I]; shared_gate_up [2Is, H]
    and shared_down [H, Is] or both None; all one float dtype -> [T, H] in x's dtype. The
    kernels run for CUDA tensors in bf16 / fp16 with T <= FUSED_MAX_TOKENS, E <= 512,
    top_k <= 16, H, I and Is multiples of 8, contiguous 16-byte aligned weights and dense x rows;
    everything else runs `moe_fused_reference`. ValueError on shapes or dtypes that do not match.
    """
    _check(x, logits, gate_up, down, top_k, shared_gate_up, shared_down)
    if x.shape[0] == 0:
        return torch.empty_like(x)
    if not fused_fits(x, logits, gate_up, down, top_k, shared_gate_up, shared_down):
        return moe_fused_reference(x, logits, gate_up, down, top_k, norm_topk_prob,
                                   shared_gate_up, shared_down)
    ops = _ext.ops()
    shared = shared_gate_up is not None
    weight, _, pair_row, row_token, tiles, n_tiles, scale, counters = ops.moe_route(
        logits, gate_up.shape[0], top_k, norm_topk_prob, shared, x.shape[1])
    return ops.moe_experts(x, gate_up, down, shared_gate_up, shared_down, weight, pair_row,
                           row_token, tiles, n_tiles, scale, counters)


def route_fused_reference(logits: torch.Tensor, num_experts: int, top_k: int,
                          norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_route's routing in torch: logits [T, E (+1)] -> (weight [T, k] fp32, expert [T, k]
    int64), experts by descending logit, ties to the lower index (stable sort)."""
    scores = logits[:, :num_experts]
    idx = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :top_k]
    if norm_topk_prob:
        weight = torch.softmax(scores.float().gather(1, idx), dim=-1)
    else:
        weight = torch.softmax(scores.float(), dim=-1).gather(1, idx)
    return weight, idx


def expert_reference(rows: torch.Tensor, gate_up: torch.Tensor,
                     down: torch.Tensor) -> torch.Tensor:
    """One expert on rows [n, H] (dtype T) -> y [n, H] fp32 with the kernels' rounding points:
    gate|up rounded to T, h = round(round(silu(gate)) · up), y = h · downᵀ in fp32."""
    act = (rows.float() @ gate_up.float().T).to(rows.dtype).float()
    gate, up = act.chunk(2, dim=-1)
    h = (F.silu(gate).to(rows.dtype).float() * up).to(rows.dtype)
    return h.float() @ down.float().T


def moe_fused_reference(x: torch.Tensor, logits: torch.Tensor, gate_up: torch.Tensor,
                        down: torch.Tensor, top_k: int, norm_topk_prob: bool,
                        shared_gate_up: torch.Tensor | None = None,
                        shared_down: torch.Tensor | None = None) -> torch.Tensor:
    """`moe_fused`'s math in torch, looping over the experts hit (host syncs): the oracle of the
    kernels, any device, any float dtype. Arguments and result as `moe_fused`."""
    _check(x, logits, gate_up, down, top_k, shared_gate_up, shared_down)
    e = gate_up.shape[0]
    weight, idx = route_fused_reference(logits, e, top_k, norm_topk_prob)
    y = torch.zeros(*idx.shape, x.shape[1], dtype=torch.float32, device=x.device)
    for expert in torch.unique(idx).tolist():
        tok, slot = torch.where(idx == expert)
        y[tok, slot] = expert_reference(x[tok], gate_up[expert], down[expert])
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(top_k):  # the kernels' order: slots, then the shared expert
        out = out + weight[:, j, None] * y[:, j]
    if shared_gate_up is not None:
        scale = torch.sigmoid(logits[:, e:].float())
        out = out + scale * expert_reference(x, shared_gate_up, shared_down)
    return out.to(x.dtype)


def grouping_reference(expert: torch.Tensor, num_experts: int,
                       shared: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """moe_route's grouping of expert [T, k]: (pair_row [T, k], row_token [T·k], tiles [n, 4]
    (expert, first row, rows, 0) with the shared expert's (expert E, token rows) first, the
    number of shared tiles). Rows by expert ascending, tokens ascending within an expert."""
    t, k = expert.shape
    flat = expert.reshape(-1)
    order = torch.sort(flat * t + torch.arange(t * k) // k, stable=True).indices
    pair_row = torch.empty_like(flat)
    pair_row[order] = torch.arange(t * k)
    tiles = [[num_experts, r, min(TILE_ROWS, t - r), 0] for r in range(0, t, TILE_ROWS)
             ] if shared else []
    n_shared = len(tiles)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    first = 0
    for e_, count in enumerate(counts):
        tiles += [[e_, first + r, min(TILE_ROWS, count - r), 0] for r in range(0, count, TILE_ROWS)]
        first += count
    return (pair_row.view(t, k), order // k, torch.tensor(tiles, dtype=torch.int64).view(-1, 4),
            n_shared)
