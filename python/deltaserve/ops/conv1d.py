"""Depthwise causal conv1d (width W) + SiLU over the GDN layer's mixed q/k/v, with per-slot windows.

The window of a request is the last W-1 conv inputs, `conv_state[slot]` [W-1, D] (oldest row
first, channel-contiguous). Row t of the output is
    y[t] = silu(bias + sum_{w<W} weight[:, w] * z[t + w]),   z = window ++ x,
accumulated in fp32 (w ascending) and cast to x's dtype; windows are stored in conv_state's dtype.
Source: transformers' Qwen3-Next `torch_causal_conv1d_update` (same math, per-slot windows here).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops import _checks as checks
from deltaserve.ops import _ext
from deltaserve.ops._exact import pointwise
from deltaserve.ops._ext import (
    KERNEL_CONV_WIDTH,
    same_kernel_dtype,
    vector_rows,
)
from deltaserve.ops.gdn import L2_EPS, _l2norm


def _conv_rows(z: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               rows: int) -> torch.Tensor:
    """z [..., W-1+rows, D] -> silu(conv) [..., rows, D] fp32; the one arithmetic path on CPU."""
    width = weight.shape[1]
    w32 = weight.float()
    acc = torch.zeros(*z.shape[:-2], rows, z.shape[-1], dtype=torch.float32, device=z.device)
    if bias is not None:
        acc = acc + bias.float()
    for i in range(width):
        acc = acc + z[..., i:i + rows, :].float() * w32[:, i]
    return pointwise(F.silu, acc)


def _kernel_ok(x, weight, bias, conv_state) -> bool:
    """The extension handles these inputs (else the reference runs, also on CUDA)."""
    return (_ext.use_extension(x, conv_state) and conv_state.shape[1] == KERNEL_CONV_WIDTH - 1
            and (weight is None or weight.shape[1] == KERNEL_CONV_WIDTH)
            and same_kernel_dtype(x, weight, bias, conv_state)
            and x.shape[-1] % (16 // x.element_size()) == 0
            and vector_rows(x, 1, 16 // x.element_size()))


def _check(x: torch.Tensor, rows: int, weight: torch.Tensor, bias: torch.Tensor | None,
           conv_state: torch.Tensor, slots: torch.Tensor, n: int | None) -> int:
    """x [., D] (rows 0: update, prefill) or [N, R, D] (rows 1: verify), weight, bias,
    conv_state, and slots [n] (n None: any count, prefill) in range; returns the count."""
    checks.floating("x", x)
    if x.dim() != 2 + rows:
        raise ValueError(f"x must have {2 + rows} dims, got shape {list(x.shape)}")
    d = x.shape[-1]
    if weight.dim() != 2 or weight.shape[0] != d:
        raise ValueError(f"weight must be [D={d}, W], got {tuple(weight.shape)}")
    if bias is not None:
        checks.shape("bias", bias, (d,))
    if conv_state.dim() != 3 or conv_state.shape[1:] != (weight.shape[1] - 1, d):
        raise ValueError(f"conv_state must be [S, W-1={weight.shape[1] - 1}, D={d}], "
                         f"got {tuple(conv_state.shape)}")
    return checks.slots(slots, n, conv_state.shape[0])


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_state: torch.Tensor, cu_seqlens: torch.Tensor,
                          slots: torch.Tensor, track_offsets: torch.Tensor | None = None,
                          track_slots: torch.Tensor | None = None) -> torch.Tensor:
    """Varlen conv + SiLU over packed sequences, continuing each from its slot's window.

    x [T, D] (bf16/fp16/fp32), weight [D, W], bias [D] or None, conv_state [S, W-1, D],
    cu_seqlens [N+1] int32 (sequence i is rows cu_seqlens[i]:cu_seqlens[i+1]), slots [N] int32.
    Sequence i starts from conv_state[slots[i]]; its final window is written back there. With
    track_offsets/track_slots [N] int32: the window after track_offsets[i] tokens of sequence i
    (0 <= offset <= length) is also written to conv_state[track_slots[i]]; track slot 0 means
    none. All windows are read before any is written. Returns y [T, D] in x's dtype.
    Raises ValueError on mismatched shapes, and on CPU on cu_seqlens that do not rise from 0 to
    T or on slots / track offsets out of range (on CUDA those values are not read: no sync).
    """
    n = _check(x, 0, weight, bias, conv_state, slots, None)
    checks.seqlens(cu_seqlens, n, x.shape[0])
    if (track_offsets is None) != (track_slots is None):
        raise ValueError("track_offsets and track_slots go together")
    if track_slots is not None:
        checks.index("track_offsets", track_offsets, n)
        checks.slots(track_slots, n, conv_state.shape[0], "track_slots")
        if not track_offsets.is_cuda:
            lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(track_offsets.dtype)
            bad = (track_slots != 0) & ((track_offsets < 0) | (track_offsets > lengths))
            if bool(bad.any()):
                raise ValueError("track_offsets must lie in 0..length of their sequence, got "
                                 f"{track_offsets.tolist()} for lengths {lengths.tolist()}")
    if _kernel_ok(x, weight, bias, conv_state):
        return _ext.ops().causal_conv1d_prefill(
            x, weight, bias, conv_state, cu_seqlens, slots, track_offsets, track_slots)
    return conv1d_prefill_ref(x, weight, bias, conv_state, cu_seqlens, slots, track_offsets,
                              track_slots)


def conv1d_prefill_ref(x, weight, bias, conv_state, cu_seqlens, slots, track_offsets=None,
                       track_slots=None) -> torch.Tensor:
    """Pure-torch causal_conv1d_prefill (any device); same contract."""
    keep = weight.shape[1] - 1
    bounds = cu_seqlens.tolist()
    slot_list = slots.tolist()
    windows = conv_state[slots.long()].clone()
    y = torch.empty_like(x)
    writes = []
    for i, slot in enumerate(slot_list):
        start, end = bounds[i], bounds[i + 1]
        z = torch.cat([windows[i].to(x.dtype), x[start:end]], dim=0)
        y[start:end] = _conv_rows(z, weight, bias, end - start).to(x.dtype)
        writes.append((slot, z[z.shape[0] - keep:]))
        if track_slots is not None and int(track_slots[i]) != 0:
            off = int(track_offsets[i])
            writes.append((int(track_slots[i]), z[off:off + keep]))
    for slot, window in writes:
        conv_state[slot] = window.to(conv_state.dtype)
    return y


def conv_qkv_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor,
                     track_offsets: torch.Tensor | None, track_slots: torch.Tensor | None, *,
                     num_k_heads: int,
                     head_k_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """causal_conv1d_prefill for a GDN layer, its output split and q, k L2-normalised.

    Arguments as causal_conv1d_prefill (x [T, D], D = 2·H·K + HV·V, channels q | k | v).
    Returns q, k [T, H, K] and v [T, D - 2·H·K], contiguous, x's dtype: q and k normalised per
    head, u * rsqrt(sum(u²) + 1e-6) in fp32 from u, the conv output as stored in x's dtype, then
    rounded to it (what gdn_chunk_prefill takes with qk_normalized=True). CUDA: one kernel
    writes the three blocks (no copy, no norm kernel) where its warp layout fits (D / (16 bytes
    of x) a multiple of 32, K/(16 bytes) a power of two up to 32), else the plain conv kernel
    and the norm below. Raises ValueError as causal_conv1d_prefill, and on 2·H·K >= D.
    """
    hk = num_k_heads * head_k_dim
    if not 0 < 2 * hk < x.shape[-1]:
        raise ValueError(f"2 * H * K = {2 * hk} must lie inside conv_dim {x.shape[-1]}")
    t = x.shape[0]
    if _kernel_ok(x, weight, bias, conv_state) and _qkv_fits(x, head_k_dim):
        _check(x, 0, weight, bias, conv_state, slots, None)
        checks.seqlens(cu_seqlens, slots.shape[0], t)
        y = _ext.ops().gdn_conv_prefill(x, weight, bias, conv_state, cu_seqlens, slots,
                                        track_offsets, track_slots, hk, head_k_dim, L2_EPS)
        q, k, v = y.split([t * hk, t * hk, t * (x.shape[-1] - 2 * hk)])
        return (q.view(t, num_k_heads, head_k_dim), k.view(t, num_k_heads, head_k_dim),
                v.view(t, -1))
    y = causal_conv1d_prefill(x, weight, bias, conv_state, cu_seqlens, slots, track_offsets,
                              track_slots)
    q, k, v = y.split([hk, hk, x.shape[-1] - 2 * hk], dim=-1)
    q, k = (_l2norm(u.reshape(t, num_k_heads, head_k_dim)).to(x.dtype) for u in (q, k))
    return q, k, v.contiguous()


def _qkv_fits(x: torch.Tensor, head_k_dim: int) -> bool:
    """gdn_conv_prefill's warp layout holds for these sizes (csrc/ops/conv1d.cu says why)."""
    vec = 16 // x.element_size()
    lanes = head_k_dim // vec
    return (head_k_dim % vec == 0 and 0 < lanes <= 32 and lanes & (lanes - 1) == 0
            and (x.shape[-1] // vec) % 32 == 0)


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One new row per request: y [N, D] (x's dtype); conv_state[slots[i]] shifted by x[i].

    x [N, D], weight [D, W], bias [D] or None, conv_state [S, W-1, D], slots [N] int32.
    Repeated slots (padding slot 0) are allowed; their window ends up holding one of the rows.
    Raises ValueError on mismatched shapes (and on CPU on slots outside [0, S)).
    """
    _check(x, 0, weight, bias, conv_state, slots, x.shape[0])
    if _kernel_ok(x, weight, bias, conv_state):
        return _ext.ops().causal_conv1d_update(x, weight, bias, conv_state, slots)
    return conv1d_update_ref(x, weight, bias, conv_state, slots)


def conv1d_update_ref(x, weight, bias, conv_state, slots) -> torch.Tensor:
    """Pure-torch causal_conv1d_update (any device); same contract."""
    idx = slots.long()
    z = torch.cat([conv_state[idx].to(x.dtype), x[:, None]], dim=1)
    y = _conv_rows(z, weight, bias, 1)[:, 0].to(x.dtype)
    conv_state[idx] = z[:, 1:].to(conv_state.dtype)
    return y


def causal_conv1d_verify(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_state: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """R rows per request from its window; the window is NOT written.

    x [N, R, D], weight [D, W], bias [D] or None, conv_state [S, W-1, D], slots [N] int32.
    Returns y [N, R, D] (x's dtype); row r equals what r+1 causal_conv1d_update steps yield.
    Advance the windows afterwards with `causal_conv1d_commit`. Raises ValueError on
    mismatched shapes (and on CPU on slots outside [0, S)).
    """
    _check(x, 1, weight, bias, conv_state, slots, x.shape[0])
    if _kernel_ok(x, weight, bias, conv_state):
        return _ext.ops().causal_conv1d_verify(x, weight, bias, conv_state, slots)
    return conv1d_verify_ref(x, weight, bias, conv_state, slots)


def conv1d_verify_ref(x, weight, bias, conv_state, slots) -> torch.Tensor:
    """Pure-torch causal_conv1d_verify (any device); same contract."""
    z = torch.cat([conv_state[slots.long()].to(x.dtype), x], dim=1)
    return _conv_rows(z, weight, bias, x.shape[1]).to(x.dtype)


def causal_conv1d_commit(x: torch.Tensor, conv_state: torch.Tensor, slots: torch.Tensor,
                         accepted: torch.Tensor) -> None:
    """Advance windows by the accepted verify rows: window <- last W-1 rows of window ++ x[:n].

    x [N, R, D] (the verify inputs), conv_state [S, W-1, D], slots [N] int32,
    accepted [N] int32 in 0..R. Equal to accepted[i] causal_conv1d_update steps on the window.
    Raises ValueError on mismatched shapes (and on CPU on slots outside [0, S)).
    """
    if x.dim() != 3:
        raise ValueError(f"x must be [N, R, D], got shape {list(x.shape)}")
    if conv_state.dim() != 3 or conv_state.shape[2] != x.shape[-1]:
        raise ValueError(f"conv_state must be [S, W-1, D={x.shape[-1]}]")
    checks.slots(slots, x.shape[0], conv_state.shape[0])
    checks.index("accepted", accepted, x.shape[0])
    if _kernel_ok(x, None, None, conv_state):
        _ext.ops().causal_conv1d_commit(x, conv_state, slots, accepted)
        return
    conv1d_commit_ref(x, conv_state, slots, accepted)


def conv1d_commit_ref(x, conv_state, slots, accepted) -> None:
    """Pure-torch causal_conv1d_commit (any device); same contract."""
    keep = conv_state.shape[1]
    idx = slots.long()
    z = torch.cat([conv_state[idx], x.to(conv_state.dtype)], dim=1)  # [N, keep + R, D]
    pos = accepted.long()[:, None] + torch.arange(keep, device=x.device)  # [N, keep]
    conv_state[idx] = torch.gather(z, 1, pos[:, :, None].expand(-1, -1, z.shape[2]))
