"""Chunked gated delta rule over a prefill batch: gates fused, chained sequences, no host sync.

The prefill counterpart of `gdn_decode`: q, k, v, the raw gate projections a, b and the layer's
A_log, dt_bias in; o and every sequence's final state out (functional: the caller gathers the
initial states from its slots and scatters the finals). Math and layouts: ops/gdn.py.

Packed sequences (`PrefillIndex`) start from their own initial states, except a *chained*
sequence, which continues from the final state of the sequence just before it. The engine
splits a request's prefill chunk at a snapshot depth into two chained sequences, so the state at
that depth comes out of the same forward, exactly (the first one's final state) — instead of
ending the chunk there and running the rest as one more forward (scheduler/snapshots.py).

CUDA: fla-core 0.6.0's chunk pipeline called stage by stage (`_fla_pipeline`, the stages of
`fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd`): the gates fused into its chunk
cumsum (`use_gate_in_kernel`), q and k L2-normalised by fla's `l2norm_fwd` unless the caller has
(ops/conv1d.conv_qkv_prefill), and the chunk indices taken from a `PrefillIndex` built once per
forward on the host. fla's public `chunk_gated_delta_rule` derives them from cu_seqlens on every
call with two host syncs (`prepare_chunk_indices`) and wraps the stages in autograd, dispatch and
`input_guard` layers: ~2 ms of host time per GDN layer on the H200 profile (issue 27). Only the
inter-chunk recurrence (`chunk_gated_delta_rule_fwd_h`) carries state from chunk to chunk, so
chaining runs it in two waves over sub-ranges of the same packed tensors (global row and chunk
offsets): wave 1 up to the last chained sequence's predecessor, wave 2 from the first chained
sequence on, started from wave 1's final states; the per-chunk stages run once. Elsewhere:
`gdn_chunk_prefill_ref` (the torch reference, chunk 64; the CPU path and the oracle).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from deltaserve.ops import _checks as checks
from deltaserve.ops import chunk_graph
from deltaserve.ops.gdn import _check_state, _heads, _l2norm, gdn_gates
from deltaserve.ops.gdn_chunk import CHUNK, chunk_gated_delta_ref

_ALIGN = 2  # int64 elements: every index array starts 16-byte aligned (Triton specialises on it)


@dataclass(frozen=True)
class Waves:
    """Where the two recurrence waves of a chained batch run (see the module doc). Sequences
    [0, last) run in wave 1 and [first, M) in wave 2; wave 2 starts sequence j from row
    `select[j - first]` of cat([initial_state[first:], wave-1 finals])."""

    first: int  # the first chained sequence
    last: int  # the last chained sequence
    first_row: int  # packed row where sequence `first` starts
    first_chunk: int  # its first chunk among all chunks
    cu1: torch.Tensor  # int64 [last + 1]: bounds of sequences 0..last-1 (global rows)
    off1: torch.Tensor  # int64 [last + 1]: their first chunks (global)
    cu2: torch.Tensor  # int64 [M - first + 1]
    off2: torch.Tensor  # int64 [M - first + 1]
    select: torch.Tensor  # int64 [M - first]


@dataclass(frozen=True)
class PrefillIndex:
    """The packed sequences of one prefill forward, built once on the host and shared by every
    GDN layer (no layer reads an index back from the device).

    bounds: host cu_seqlens [M+1] (non-decreasing from 0); chained: host [M] bools;
    cu_seqlens int64 [M+1], chunk_indices int64 [NT, 2] ((sequence, chunk within it) per
    64-token chunk: fla's `prepare_chunk_indices`), chunk_offsets int64 [M+1] (each sequence's
    first chunk: fla's `prepare_chunk_offsets`), all on the device; waves when any is chained.
    graphs: the forward's replayed pipelines (ops/chunk_graph.py), filled by the GDN layers.
    """

    bounds: tuple[int, ...]
    chained: tuple[bool, ...]
    cu_seqlens: torch.Tensor
    chunk_indices: torch.Tensor
    chunk_offsets: torch.Tensor
    waves: Waves | None
    graphs: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_seqs(self) -> int:
        return len(self.chained)

    @property
    def num_tokens(self) -> int:
        return self.bounds[-1]

    @classmethod
    def build(cls, bounds: Sequence[int], chained: Sequence[bool] | None = None,
              device: torch.device | str = "cpu",
              upload: Callable[[np.ndarray], torch.Tensor] | None = None) -> PrefillIndex:
        """From host bounds [M+1] and chained [M] (None: none). `upload(int64 array)` makes
        the device copy (default: a plain `.to(device)`; the engine passes its pinned staging
        copy): one copy for all arrays. Raises ValueError on bounds that do not rise from 0, on
        a chained first sequence or a chained sequence whose predecessor is chained too (two
        waves cover one link), or on an empty sequence in a chain."""
        b = [int(x) for x in bounds]
        m = len(b) - 1
        if m < 1 or b[0] != 0 or any(x > y for x, y in zip(b, b[1:])):
            raise ValueError(f"bounds must rise from 0 over at least one sequence, got {b}")
        ch = tuple(bool(c) for c in chained) if chained is not None else (False,) * m
        if len(ch) != m:
            raise ValueError(f"chained must have one entry per sequence ({m}), got {len(ch)}")
        links = [j for j in range(m) if ch[j]]
        for j in links:
            if j == 0 or ch[j - 1] or b[j] == b[j - 1] or b[j + 1] == b[j]:
                raise ValueError(f"sequence {j} cannot be chained: it needs a non-empty, "
                                 f"unchained predecessor and rows of its own (chained={ch}, "
                                 f"bounds={b})")
        lens = np.diff(np.asarray(b, dtype=np.int64))
        counts = -(-lens // CHUNK)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        seq = np.repeat(np.arange(m, dtype=np.int64), counts)
        within = np.arange(offsets[-1], dtype=np.int64) - np.repeat(offsets[:-1], counts)
        parts = [np.asarray(b, dtype=np.int64), np.stack([seq, within], 1).reshape(-1), offsets]
        if links:
            first, last = links[0], links[-1]
            select = [(m - first) + j - 1 if ch[j] else j - first for j in range(first, m)]
            parts += [parts[0][:last + 1], offsets[:last + 1], parts[0][first:],
                      offsets[first:], np.asarray(select, dtype=np.int64)]
        starts, pos = [], 0
        for p in parts:
            starts.append(pos)
            pos += -(-len(p) // _ALIGN) * _ALIGN
        flat = np.zeros(max(pos, 1), dtype=np.int64)
        for s, p in zip(starts, parts):
            flat[s:s + len(p)] = p
        dev = (upload or (lambda a: torch.from_numpy(a).to(device)))(flat)
        views = [dev[s:s + len(p)] for s, p in zip(starts, parts)]
        waves = None
        if links:
            waves = Waves(first, last, b[first], int(offsets[first]), *views[3:])
        return cls(tuple(b), ch, views[0], views[1].view(-1, 2), views[2], waves)


def gdn_chunk_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor,
                      b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
                      initial_state: torch.Tensor, index: PrefillIndex, scale: float, *,
                      qk_normalized: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over the packed sequences of `index`, gates computed inside.

    q, k [T, H, K], v [T, HV, V] (bf16/fp16/fp32; views allowed), a, b [T, HV] (the raw
    projections: g = -exp(A_log) softplus(a + dt_bias), beta = sigmoid(b) in fp32), A_log,
    dt_bias [HV] fp32, initial_state [M, HV, V, K] fp32 (row j: sequence j's; a chained
    sequence's row is not read), scale = K^-1/2. qk_normalized: q and k are already
    L2-normalised (eps 1e-6; conv_qkv_prefill's outputs), else they are normalised here.
    Returns (o [T, HV, V] in v's dtype, final_state [M, HV, V, K] fp32: the state after each
    sequence, so a chained sequence's predecessor's row is the state at the split).
    Raises ValueError on mismatched shapes. Source: Yang et al. 2024 (Gated Delta Networks),
    chunked as fla-core / transformers' `torch_chunk_gated_delta_rule`.
    """
    _check(q, k, v, a, b, initial_state, index)
    for name, t in (("A_log", A_log), ("dt_bias", dt_bias)):
        checks.shape(name, t, (v.shape[1],))
    if q.is_cuda:
        if chunk_graph.eligible(index.num_tokens, v):
            # the layers after the first replay the first's launches (ops/chunk_graph.py); the
            # pipeline reads a copy of the index without the graphs (no reference cycle)
            inputs = (q, k, v, a, b, A_log, dt_bias, initial_state)
            key = (scale, qk_normalized, *((x.shape, x.dtype) for x in inputs))
            # the same kernels for any token and sequence count (ops/chunk_graph.py); a
            # chained forward launches a second recurrence
            warm = (scale, qk_normalized, index.waves is not None,
                    *((x.shape[1:], x.dtype) for x in inputs))

            def make():
                plain = replace(index, graphs={})
                return lambda *xs: _fla_call(*xs, scale, plain, qk_normalized)

            return chunk_graph.replayed(index.graphs, key, make, inputs, warm)
        return _fla_call(q, k, v, a, b, A_log, dt_bias, initial_state, scale, index,
                         qk_normalized)
    return gdn_chunk_prefill_ref(q, k, v, a, b, A_log, dt_bias, initial_state, index, scale,
                                 qk_normalized=qk_normalized)


def _fla_call(q, k, v, a, b, A_log, dt_bias, initial_state, scale: float,
              index: PrefillIndex, qk_normalized: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """gdn_chunk_prefill on CUDA, through fla-core's stages."""
    from fla.modules.norm.l2norm import l2norm_fwd

    if not qk_normalized:
        q, k = l2norm_fwd(q.contiguous())[0], l2norm_fwd(k.contiguous())[0]
    beta = torch.sigmoid(b.float()).contiguous()
    return _fla_pipeline(q.contiguous(), k.contiguous(), v.contiguous(), beta, scale,
                         initial_state.contiguous(), index, gate=(a, A_log, dt_bias))


def gdn_chunk_prefill_ref(q, k, v, a, b, A_log, dt_bias, initial_state, index: PrefillIndex,
                          scale: float, *, qk_normalized: bool = False):
    """Pure-torch gdn_chunk_prefill (any device); same contract. The same arithmetic as
    gdn.gdn_prefill's reference on each sequence (a sequence's math never depends on the
    others), one sequence at a time so a chained one can start from its predecessor."""
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    hv = v.shape[-2]
    qn = q.float() if qk_normalized else _l2norm(q)
    kn = k.float() if qk_normalized else _l2norm(k)
    return chained_ref(_heads(qn * scale, hv), _heads(kn, hv), v, g, beta, initial_state, index)


def chained_ref(q, k, v, g, beta, initial_state, index: PrefillIndex):
    """chunk_gated_delta_ref (q, k prepared: normalised, q scaled, HV heads) sequence by
    sequence, a chained one from its predecessor's final state."""
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    finals = []
    for j, (lo, hi) in enumerate(zip(index.bounds, index.bounds[1:])):
        h0 = finals[j - 1] if index.chained[j] else initial_state[j]
        span = torch.tensor([0, hi - lo])
        o[lo:hi], final = chunk_gated_delta_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi],
                                                beta[lo:hi], h0[None], span)
        finals.append(final[0])
    return o, torch.stack(finals)


def _check(q, k, v, a, b, initial_state, index: PrefillIndex) -> None:
    if v.dim() != 3:
        raise ValueError(f"v must be [T, HV, V], got shape {list(v.shape)}")
    t, hv = v.shape[0], v.shape[1]
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.floating(name, x)
    checks.shape("q", q, (t, None, None))
    checks.shape("k", k, tuple(q.shape))
    if hv % q.shape[1]:
        raise ValueError(f"HV={hv} must be a multiple of H={q.shape[1]}")
    checks.shape("a", a, (t, hv))
    checks.shape("b", b, (t, hv))
    if initial_state.dim() != 4:
        raise ValueError(f"initial_state must be [M, HV, V, K], got {list(initial_state.shape)}")
    _check_state(initial_state, v, k)
    if initial_state.shape[0] != index.num_seqs or index.num_tokens != t:
        raise ValueError(f"index covers {index.num_seqs} sequences of {index.num_tokens} rows; "
                         f"got initial_state for {initial_state.shape[0]} and {t} rows")


def _fla_pipeline(q, k, v, beta, scale, initial_state, index: PrefillIndex, *, g=None,
                  gate=None):
    """fla-core 0.6.0's chunk forward, stage by stage (chunk.py: chunk_gated_delta_rule_fwd).

    q, k [T, H, K] normalised, v [T, HV, V], contiguous; beta [T, HV] fp32; either g [T, HV]
    fp32 (log decay) or gate = (a [T, HV] raw, A_log, dt_bias) fused into the chunk cumsum;
    initial_state [M, HV, V, K] fp32 contiguous -> (o [T, HV, V], finals [M, HV, V, K] fp32).
    """
    from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
    from fla.ops.common.chunk_o import chunk_fwd_o
    from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
    from fla.ops.gated_delta_rule.gate import gdn_gate_chunk_cumsum
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    cu, ci = index.cu_seqlens, index.chunk_indices
    if gate is not None:
        a, A_log, dt_bias = gate
        gc = gdn_gate_chunk_cumsum(g=a[None], A_log=A_log, chunk_size=CHUNK, scale=RCP_LN2,
                                   dt_bias=dt_bias, cu_seqlens=cu, chunk_indices=ci)
    else:
        gc = chunk_local_cumsum(g[None], chunk_size=CHUNK, scale=RCP_LN2, cu_seqlens=cu,
                                chunk_indices=ci)
    q4, k4, v4 = q[None], k[None], v[None]
    w, u, _ = chunk_gated_delta_rule_fwd_intra(k=k4, v=v4, g=gc, beta=beta[None],
                                               cu_seqlens=cu, chunk_indices=ci,
                                               chunk_size=CHUNK)

    def recurrence(cu_w, off_w, h0):
        # chunk_indices only sizes h (all chunks); the wave's sequences come from cu_w/off_w
        return chunk_gated_delta_rule_fwd_h(
            k=k4, w=w, u=u, g=gc, initial_state=h0, output_final_state=True,
            chunk_size=CHUNK, state_v_first=True, cu_seqlens=cu_w, chunk_indices=ci,
            chunk_offsets=off_w)

    wv = index.waves
    if wv is None:
        h, v_new, final = recurrence(cu, index.chunk_offsets, initial_state)
    else:
        h, v_new, final1 = recurrence(wv.cu1, wv.off1, initial_state[:wv.last])
        if wv.first == index.num_seqs - 1:  # one chained sequence, the last (one request)
            h0 = final1[wv.first - 1:]
        else:
            h0 = torch.cat([initial_state[wv.first:], final1]).index_select(0, wv.select)
        h2, v_new2, final2 = recurrence(wv.cu2, wv.off2, h0)
        h[:, wv.first_chunk:] = h2[:, wv.first_chunk:]
        v_new[:, wv.first_row:] = v_new2[:, wv.first_row:]
        final = torch.cat([final1[:wv.first], final2])
    o = chunk_fwd_o(q=q4, k=k4, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu,
                    chunk_indices=ci, state_v_first=True, chunk_size=CHUNK)
    return o[0], final
