"""Gated DeltaNet recurrence: gates, chunked prefill, decode, verify with input stash, replay.

State layout: per value head a [V, K] fp32 matrix (K contiguous), pools `[S, HV, V, K]`.
Value head hv reads key head hv // (HV // H). Per row (Yang et al. 2024, Gated Delta
Networks, eq. 10), with q, k L2-normalised (eps 1e-6) and q scaled by `scale`:
    S <- exp(g) * S;   S <- S + beta * (v - S k) k^T;   o = S q.
Gates: g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b), fp32.

On CPU, decode, verify and replay run ONE step function (`_step`), so replaying n stashed rows
is bitwise equal to n decode steps and verify outputs are bitwise equal to decode outputs. The
CUDA kernels keep the same promise among themselves (one device function), not with the CPU:
they take o = (exp(g) S) q + delta (k . q) with delta = beta (v - exp(g) S k), equal to the
o above in exact arithmetic (docs/kernels.md), so their outputs differ from these by rounding.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from deltaserve.ops import _checks as checks
from deltaserve.ops import _ext
from deltaserve.ops._exact import pointwise
from deltaserve.ops._ext import (
    KERNEL_HEAD_DIMS,
    same_kernel_dtype,
    vector_rows,
)
from deltaserve.ops.gdn_chunk import chunk_gated_delta_ref

VERIFY_PENDING_MAX_ROWS = 8  # the kernels stage a verify's pending rows as one chunk (kChunk)

L2_EPS = 1e-6


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor,
              dt_bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) fp32 from the projections a, b [..., HV] and the parameters A_log, dt_bias [HV].

    g = -exp(A_log) * softplus(a + dt_bias) (log decay, <= 0), beta = sigmoid(b).
    Source: transformers Qwen3NextGatedDeltaNet.forward.
    """
    g = -pointwise(torch.exp, A_log.float()) * pointwise(F.softplus, a.float() + dt_bias.float())
    return g, pointwise(torch.sigmoid, b.float())


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    x = x.float()
    return x * pointwise(torch.rsqrt, (x * x).sum(-1, keepdim=True) + L2_EPS)


def _heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """[..., H, K] -> [..., HV, K] (value head hv uses key head hv // (HV // H))."""
    h = x.shape[-2]
    if hv % h:
        raise ValueError(f"HV={hv} must be a multiple of H={h}")
    return x if h == hv else x.repeat_interleave(hv // h, dim=-2)


def _step(state: torch.Tensor, q: torch.Tensor | None, k: torch.Tensor, v: torch.Tensor,
          g: torch.Tensor, beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One recurrence row for a batch: state [N, HV, V, K] fp32, q/k [N, HV, K] (normalised,
    q scaled), v [N, HV, V], g/beta [N, HV] fp32 -> (new state, o [N, HV, V] fp32 or None)."""
    s = state * pointwise(torch.exp, g)[:, :, None, None]
    kv = (s * k[:, :, None, :]).sum(-1)
    delta = (v - kv) * beta[:, :, None]
    s = s + delta[:, :, :, None] * k[:, :, None, :]
    o = None if q is None else (s * q[:, :, None, :]).sum(-1)
    return s, o


def _prepare(q, k, v, a, b, A_log, dt_bias, scale):
    """Inputs with any leading dims -> (qn*scale [.., H, K], kn [.., H, K], v, g, beta) fp32."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    return _l2norm(q) * scale, _l2norm(k), v.float(), g, beta


def _kernel_ok(q, k, v, a, b, state) -> bool:
    """The extension handles these inputs (else the reference runs, also on CUDA)."""
    return (_ext.use_extension(q, state) and q.shape[-1] in KERNEL_HEAD_DIMS
            and same_kernel_dtype(q, k, v, a, b) and vector_rows(q, 2, 4)
            and vector_rows(k, 2, 4) and v.stride(-1) == 1 and v.stride(-2) == v.shape[-1]
            and a.stride(-1) == 1 and b.stride(-1) == 1)


def _check_state(state: torch.Tensor, v: torch.Tensor, k: torch.Tensor) -> None:
    hv, vd, kd = v.shape[-2], v.shape[-1], k.shape[-1]
    if state.dtype != torch.float32 or state.shape[-3:] != (hv, vd, kd):
        raise ValueError(f"state must be fp32 [..., HV={hv}, V={vd}, K={kd}], "
                         f"got {state.dtype} {tuple(state.shape)}")


def _check_rows(q, k, v, a, b, A_log, dt_bias, state, slots, lead: int) -> None:
    """Shapes of a decode (lead 1: [N, ...]) or verify (lead 2: [N, R, ...]) call, and on CPU
    the slot range; then the state (fp32 [S, HV, V, K])."""
    if v.dim() != lead + 2:
        want = "[N, HV, V]" if lead == 1 else "[N, R, HV, V]"
        raise ValueError(f"v must be {want}, got shape {list(v.shape)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        checks.floating(name, t)
    rows, hv = tuple(v.shape[:lead]), v.shape[lead]
    checks.shape("q", q, (*rows, None, None))
    checks.shape("k", k, tuple(q.shape))
    if hv % q.shape[-2]:  # the reference's _heads says so too; this covers the kernel path
        raise ValueError(f"HV={hv} must be a multiple of H={q.shape[-2]}")
    checks.shape("a", a, (*rows, hv))
    checks.shape("b", b, (*rows, hv))
    checks.shape("A_log", A_log, (hv,))
    checks.shape("dt_bias", dt_bias, (hv,))
    if state.dim() != 4:
        raise ValueError(f"state must be [S, HV, V, K] (one layer), got {list(state.shape)}")
    _check_state(state, v, k)
    checks.slots(slots, rows[0], state.shape[0])


def gdn_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, scale: float) -> torch.Tensor:
    """One recurrence row per request; gates, L2 norm and scale fused; state updated in place.

    q, k [N, H, K], v [N, HV, V] (bf16/fp16/fp32), a, b [N, HV], A_log, dt_bias [HV],
    state [S, HV, V, K] fp32 (one layer of the pool), slots [N] int32, scale = K^-1/2.
    Returns o [N, HV, V] in v's dtype. Requests sharing a slot (padding slot 0) race; their
    outputs are unspecified. Raises ValueError on mismatched shapes, a bad state shape/dtype,
    HV % H != 0, or (on CPU) slots outside [0, S).
    """
    _check_rows(q, k, v, a, b, A_log, dt_bias, state, slots, 1)
    if _kernel_ok(q, k, v, a, b, state):
        return _ext.ops().gdn_decode(q, k, v, a, b, A_log.float(), dt_bias.float(), state,
                                     slots, scale)
    return gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, state, slots, scale)


def gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, state, slots, scale) -> torch.Tensor:
    """Pure-torch gdn_decode (any device); same contract."""
    hv = v.shape[-2]
    qn, kn, vf, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, scale)
    idx = slots.long()
    s, o = _step(state[idx], _heads(qn, hv), _heads(kn, hv), vf, g, beta)
    state[idx] = s
    return o.to(v.dtype)


@dataclass
class GDNStash:
    """Per verify row, the recurrence inputs replay needs, for every GDN layer.

    k [L, N, R, H, K] fp32 (L2-normalised), v [L, N, R, HV, V] fp32, g / beta [L, N, R, HV]
    fp32, with N = max requests and R = max rows per request. Written by `gdn_verify`, read
    by `gdn_replay`; fixed addresses (safe to capture in CUDA graphs).
    """

    k: torch.Tensor
    v: torch.Tensor
    g: torch.Tensor
    beta: torch.Tensor

    @classmethod
    def allocate(cls, num_layers: int, max_reqs: int, max_rows: int, H: int, HV: int, K: int,
                 V: int, device: torch.device | str) -> GDNStash:
        """Zero-filled buffers for `num_layers` x `max_reqs` x `max_rows` rows."""
        shape = (num_layers, max_reqs, max_rows)
        f32 = dict(dtype=torch.float32, device=device)
        return cls(k=torch.zeros(*shape, H, K, **f32), v=torch.zeros(*shape, HV, V, **f32),
                   g=torch.zeros(*shape, HV, **f32), beta=torch.zeros(*shape, HV, **f32))

    @property
    def num_layers(self) -> int:
        return self.k.shape[0]

    @property
    def max_reqs(self) -> int:
        return self.k.shape[1]

    @property
    def max_rows(self) -> int:
        return self.k.shape[2]


def gdn_verify(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
               b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
               state: torch.Tensor, slots: torch.Tensor, scale: float, stash: GDNStash,
               layer: int, pending: tuple[GDNStash, torch.Tensor] | None = None) -> torch.Tensor:
    """R speculative rows per request from its live state; the state is only read.

    q, k [N, R, H, K], v [N, R, HV, V], a, b [N, R, HV], A_log, dt_bias [HV],
    state [S, HV, V, K] fp32, slots [N] int32, scale = K^-1/2, stash with N <= max_reqs,
    R <= max_rows. Returns o [N, R, HV, V] (v's dtype); row r equals the output of the
    (r+1)-th of r+1 gdn_decode steps (bitwise on CPU and among the CUDA kernels). Writes
    stash.{k,v,g,beta}[layer, :N, :R].

    pending = (prev, rows): first apply the first rows[i] (int32 [N], clamped to
    0..stash.max_rows) rows of `prev` (the previous verify's stash, a distinct buffer of the
    stash's shapes) to request i's state, in place, as `gdn_replay` would for this layer; then
    verify from that state.
    On CUDA both happen in one launch (the state is read once and written once); bitwise equal
    to gdn_replay followed by gdn_verify. Raises ValueError on mismatched shapes, when R < 1,
    when the stash is too small or when `prev` does not match it (and on CPU on slots outside
    [0, S)).
    """
    _check_rows(q, k, v, a, b, A_log, dt_bias, state, slots, 2)
    n, r = v.shape[0], v.shape[1]
    if r < 1:
        raise ValueError(f"gdn_verify needs R >= 1 rows per request, got v of shape "
                         f"{tuple(v.shape)}")
    if n > stash.max_reqs or r > stash.max_rows or not 0 <= layer < stash.num_layers:
        raise ValueError(f"stash holds {stash.num_layers} layers x {stash.max_reqs} requests "
                         f"x {stash.max_rows} rows; got layer {layer}, N={n}, R={r}")
    if pending is not None:
        prev, rows = pending
        if prev.k.shape != stash.k.shape or prev.v.shape != stash.v.shape or prev.k is stash.k:
            raise ValueError("pending: the previous stash must be a second buffer of the "
                             f"stash's shapes {tuple(stash.k.shape)}")
        if rows.shape != (n,):
            raise ValueError(f"pending rows must be [N={n}], got {tuple(rows.shape)}")
    kernel = _kernel_ok(q, k, v, a, b, state)
    if pending is not None and not (kernel and stash.max_rows <= VERIFY_PENDING_MAX_ROWS):
        prev, rows = pending  # replay this layer on its own first
        one = GDNStash(*(x[layer:layer + 1] for x in (prev.k, prev.v, prev.g, prev.beta)))
        gdn_replay(one, state[None], slots, rows)
        pending = None
    if kernel:
        args = (q, k, v, a, b, A_log.float(), dt_bias.float(), state, slots, scale, stash.k,
                stash.v, stash.g, stash.beta, layer)
        if pending is None:
            return _ext.ops().gdn_verify(*args)
        prev, rows = pending
        return _ext.ops().gdn_replay_verify(
            *args, prev.k, prev.v, prev.g, prev.beta, rows.to(torch.int32).contiguous())
    return gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, state, slots, scale, stash, layer)


def gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, state, slots, scale, stash,
                   layer) -> torch.Tensor:
    """Pure-torch gdn_verify without pending rows (any device); same contract."""
    n, r, hv = v.shape[0], v.shape[1], v.shape[-2]
    qn, kn, vf, g, beta = _prepare(q, k, v, a, b, A_log, dt_bias, scale)
    stash.k[layer, :n, :r] = kn
    stash.v[layer, :n, :r] = vf
    stash.g[layer, :n, :r] = g
    stash.beta[layer, :n, :r] = beta
    qh, kh = _heads(qn, hv), _heads(kn, hv)
    s = state[slots.long()]
    outs = []
    for i in range(r):
        s, o = _step(s, qh[:, i], kh[:, i], vf[:, i], g[:, i], beta[:, i])
        outs.append(o)
    return torch.stack(outs, dim=1).to(v.dtype)


def gdn_replay(stash: GDNStash, state_pool: torch.Tensor, slots: torch.Tensor,
               accepted: torch.Tensor) -> None:
    """Apply the first accepted[i] stashed rows of request i to its live state, every layer.

    stash written by gdn_verify for all L layers, state_pool [L, S, HV, V, K] fp32,
    slots [N] int32 (the verify batch's slots, same order), accepted [N] int32 in 0..R.
    Bitwise equal to accepted[i] gdn_decode steps on the same inputs. In place; one launch
    on CUDA. Raises ValueError on a pool/stash mismatch, on accepted not matching slots, or
    (on CPU) on slots outside [0, S).
    """
    n = checks.index("slots", slots)
    checks.index("accepted", accepted, n)
    if state_pool.dim() != 5 or state_pool.shape[0] != stash.num_layers:
        raise ValueError(f"state_pool must be [L={stash.num_layers}, S, HV, V, K], "
                         f"got {tuple(state_pool.shape)}")
    _check_state(state_pool, stash.v, stash.k)
    if n > stash.max_reqs:
        raise ValueError(f"N={n} exceeds the stash's {stash.max_reqs} requests")
    checks.in_range("slots", slots, 0, state_pool.shape[1])
    if _ext.use_extension(state_pool, stash.k) and state_pool.shape[-1] in KERNEL_HEAD_DIMS:
        _ext.ops().gdn_replay(stash.k, stash.v, stash.g, stash.beta, state_pool, slots,
                              accepted)
        return
    gdn_replay_ref(stash, state_pool, slots, accepted)


def gdn_replay_ref(stash: GDNStash, state_pool: torch.Tensor, slots: torch.Tensor,
                   accepted: torch.Tensor) -> None:
    """Pure-torch gdn_replay (any device); same contract."""
    n = slots.shape[0]
    if n == 0:
        return
    hv = state_pool.shape[2]
    idx = slots.long()
    acc = accepted.long().to(state_pool.device).clamp(0, stash.max_rows)
    for layer in range(stash.num_layers):
        s = state_pool[layer, idx]
        kh = _heads(stash.k[layer, :n], hv)
        # every stash row, masked: no host sync on `accepted` (a verify with pending rows runs
        # this inside CUDA graph capture when the kernels do not take its shapes)
        for i in range(stash.max_rows):
            new, _ = _step(s, None, kh[:, i], stash.v[layer, :n, i], stash.g[layer, :n, i],
                           stash.beta[layer, :n, i])
            s = torch.where((acc > i)[:, None, None, None], new, s)
        state_pool[layer, idx] = s


def gdn_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over packed sequences (functional: no slots).

    q, k [T, H, K] (NOT normalised: normalised inside), v [T, HV, V], g, beta [T, HV] fp32
    (from gdn_gates), initial_state [N, HV, V, K] fp32, cu_seqlens [N+1] int32, scale.
    Returns (o [T, HV, V] in v's dtype, final_state [N, HV, V, K] fp32).
    CUDA: fla-core `chunk_gated_delta_rule` (state_v_first=True keeps our [V, K] layout);
    elsewhere `chunk_gated_delta_ref` (chunk 64, the math of transformers'
    `torch_chunk_gated_delta_rule`, in our layout). Raises ValueError on mismatched shapes,
    and on CPU on cu_seqlens that do not rise from 0 to T.
    """
    if v.dim() != 3:
        raise ValueError(f"v must be [T, HV, V], got shape {list(v.shape)}")
    t, hv = v.shape[0], v.shape[1]
    checks.shape("q", q, (t, None, None))
    checks.shape("k", k, tuple(q.shape))
    checks.shape("g", g, (t, hv))
    checks.shape("beta", beta, (t, hv))
    if initial_state.dim() != 4:
        raise ValueError(f"initial_state must be [N, HV, V, K], got {list(initial_state.shape)}")
    _check_state(initial_state, v, k)
    checks.seqlens(cu_seqlens, initial_state.shape[0], t)
    if q.is_cuda:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule

        o, final = chunk_gated_delta_rule(
            q[None], k[None], v[None], g[None].float(), beta[None].float(), scale=scale,
            initial_state=initial_state.contiguous(), output_final_state=True,
            use_qk_l2norm_in_kernel=True, state_v_first=True, cu_seqlens=cu_seqlens.long())
        return o[0].to(v.dtype), final.float()
    return chunk_gated_delta_ref(_heads(_l2norm(q) * scale, v.shape[-2]),
                                 _heads(_l2norm(k), v.shape[-2]), v, g.float(), beta.float(),
                                 initial_state, cu_seqlens)
