"""Batched token sampling for decode and verify rows: penalties, temperature, top-k, top-p, min-p.

One call samples every row of a [R, V] logits tensor on its device, each row with its own
request's parameters (per-row tensors), with no loop over rows and no device->host copy
inside; the caller copies the tokens back once. Math follows vLLM's sampler, in its order:
penalties (repetition as in CTRL, Keskar et al. 2019, eq. 2, over prompt and output;
presence/frequency as in the OpenAI API, over the output), temperature, top-k / top-p /
min-p truncation of the softmax, then one draw. Greedy rows (temperature < 1e-5 or top-k 1)
take the argmax of the penalised logits in the same call (ties: lowest id).

The draw is inverse-CDF sampling with one counter-based uniform u per row
(engine/sampling_rng.py): the first token whose cumulative weight exceeds u * total. That is
one cumsum over V instead of per-token noise (a Gumbel-max / exponential-race draw hashes
every (row, token): ~15 int64 passes over [R, V], more than the whole rest of the sampler at
V = 248,320); FlashInfer's samplers also draw one uniform per row. Because u depends only on
(seed, position), a verify row j samples exactly as the j-th later decode step would (its
drafts before it count as generated: `SamplingRow.drafts`), and a request's tokens do not
depend on the rest of its batch. Reproducible for a seed on the same device and build (the
fp32 softmax/CDF are the device's; the uniforms are bit-identical everywhere).

Penalty rows get their token counts from padded [P, L] id tensors built per step (vLLM's
approach): simple and exact, but O(prompt + output) host work per penalty row per step; a
device-resident count per slot would remove that (not done yet).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.core import FP32_MAX, SamplingParams
from deltaserve.engine.sampling_rng import row_uniforms
from deltaserve.engine.staging import to_device


@dataclass(slots=True)
class SamplingRow:
    """What sampling one logits row needs.

    The row samples the token at output position `len(output_ids) + len(drafts) + ahead`;
    `drafts` (a verify row's drafts before it) count as generated for the penalties; `ahead`
    counts tokens already sampled on the device but not yet in `output_ids` (an overlapped
    decode row, engine/overlap.py; such rows have no penalties). `seed` is the request's
    (drawn at admission when it gave none), any integer in [-2**63, 2**64).
    """

    params: SamplingParams
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    seed: int
    drafts: Sequence[int] = ()
    ahead: int = 0

    @property
    def position(self) -> int:
        return len(self.output_ids) + len(self.drafts) + self.ahead


def has_penalties(p: SamplingParams) -> bool:
    """Whether sampling with `p` reads the request's tokens (repetition, presence or
    frequency penalty): such a row needs its output ids on the host for every step."""
    return p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


@dataclass(slots=True)
class SamplingTensors:
    """One step's per-row sampling parameters, on the logits' device (built by `build`).

    Sampled rows (S of them, `sample_idx` [S] int64, None when every row samples):
    temperature, top_p, min_p fp32 [S]; top_k int64 [S] in [2, V] (V: off); seed (as
    `to_int64`), position int64 [S]. Penalty rows (P, `penalty_idx` [P] int64): repetition,
    presence, frequency fp32 [P]; prompt_ids [P, Lp] (None when no row has a repetition
    penalty) and output_ids [P, Lg] int64, padded with V. Host-side flags pick the work:
    `k_max` (largest active top-k, 0 none), `any_top_p`, `any_min_p`.
    """

    rows: int
    plain_greedy: bool = True
    n_sample: int = 0
    sample_idx: torch.Tensor | None = None
    temperature: torch.Tensor | None = None
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    seed: torch.Tensor | None = None
    position: torch.Tensor | None = None
    k_max: int = 0
    any_top_p: bool = False
    any_min_p: bool = False
    penalty_idx: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    prompt_ids: torch.Tensor | None = None
    output_ids: torch.Tensor | None = None

    @classmethod
    def build(cls, rows: Sequence[SamplingRow], vocab: int,
              device: torch.device) -> SamplingTensors:
        """The tensors for `rows` on `device`: host work O(R + the penalty rows' ids), two
        host->device copies from pinned memory (none when every row is plain greedy)."""
        samp, top_k, seeds, pos, temp, top_p, min_p, pen, pen_params = ([] for _ in range(9))
        for i, r in enumerate(rows):  # one pass: this runs on the host every step
            p = r.params
            if has_penalties(p):
                pen.append(i)
                pen_params.append(p)
            if p.greedy:
                continue
            samp.append(i)
            top_k.append(p.top_k if 0 < p.top_k < vocab else vocab)
            seeds.append(r.seed if r.seed < 1 << 63 else r.seed - (1 << 64))  # = to_int64
            pos.append(len(r.output_ids) + len(r.drafts) + r.ahead)
            temp.append(p.temperature)
            top_p.append(p.top_p)
            min_p.append(p.min_p)
        if not samp and not pen:
            return cls(len(rows))
        any_rep = any(p.repetition_penalty != 1.0 for p in pen_params)
        prompt = _padded([rows[i].prompt_ids if q.repetition_penalty != 1.0 else ()
                          for i, q in zip(pen, pen_params)], vocab) if any_rep else None
        output = _padded([list(rows[i].output_ids) + list(rows[i].drafts) for i in pen], vocab)
        ints = [_i64(samp), _i64(top_k), _i64(seeds), _i64(pos), _i64(pen)] \
            + ([prompt.ravel()] if any_rep else []) + [output.ravel()]
        floats = [_f32(temp), _f32(top_p), _f32(min_p),
                  _f32([q.repetition_penalty for q in pen_params]),
                  _f32([q.presence_penalty for q in pen_params]),
                  _f32([q.frequency_penalty for q in pen_params])]
        iv = _split(to_device(np.concatenate(ints), torch.int64, device), ints)
        fv = _split(to_device(np.concatenate(floats), torch.float32, device), floats)
        s, p = len(samp), len(pen)
        st = cls(len(rows), plain_greedy=False, n_sample=s,
                 sample_idx=iv[0] if s < len(rows) else None, top_k=iv[1], seed=iv[2],
                 position=iv[3], temperature=fv[0], top_p=fv[1], min_p=fv[2],
                 k_max=max((k for k in top_k if k < vocab), default=0),
                 any_top_p=any(x < 1.0 for x in top_p), any_min_p=any(x > 0.0 for x in min_p))
        if p:
            st.penalty_idx, st.repetition, st.presence, st.frequency = iv[4], fv[3], fv[4], fv[5]
            st.prompt_ids = iv[5].view(p, -1) if any_rep else None
            st.output_ids = iv[-1].view(p, -1)
        return st


def _padded(id_lists: list[Sequence[int]], vocab: int) -> np.ndarray:
    """[P, max(1, longest)] int64, ids >= vocab and the padding both mapped to `vocab`."""
    out = np.full((len(id_lists), max([1] + [len(x) for x in id_lists])), vocab, np.int64)
    for i, ids in enumerate(id_lists):
        out[i, :len(ids)] = ids
    return np.minimum(out, vocab)


def _i64(values) -> np.ndarray:
    return np.asarray(values, dtype=np.int64)


def _f32(values) -> np.ndarray:
    # the parameters are Python floats (double): cast once here, as a tensor op on an fp32
    # tensor casts its Python scalar (the reference's arithmetic)
    return np.asarray(values, dtype=np.float32)


def _split(flat: torch.Tensor, parts: list[np.ndarray]) -> list[torch.Tensor]:
    return list(torch.split(flat, [p.size for p in parts]))


def apply_penalties(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """The penalty rows of logits [P, V] fp32 (already gathered) -> penalised [P, V].

    Repetition (prompt or output tokens): positive logits divided by the penalty (clamped to
    the largest finite fp32, so a penalty that rounds to 0 keeps the token on top instead of
    making inf and a NaN softmax), others multiplied. Then minus frequency * count + presence
    * (count > 0) over the output tokens (drafts included). Same arithmetic as
    `apply_penalties_ref`, so the results are equal, not just close.
    """
    p, vocab = logits.shape
    ones = torch.ones_like(st.output_ids, dtype=torch.float32)
    counts = torch.zeros(p, vocab + 1, device=logits.device).scatter_add_(
        1, st.output_ids, ones)[:, :vocab]
    in_output = counts > 0
    rep = st.repetition[:, None]
    seen = in_output
    if st.prompt_ids is not None:
        in_prompt = torch.zeros(p, vocab + 1, dtype=torch.bool, device=logits.device)
        seen = in_prompt.scatter_(1, st.prompt_ids, True)[:, :vocab] | in_output
    penalised = torch.where(logits > 0, (logits / rep).clamp(max=FP32_MAX), logits * rep)
    logits = torch.where(seen & (rep != 1.0), penalised, logits)
    return logits - (st.frequency[:, None] * counts
                     + st.presence[:, None] * in_output.to(torch.float32))


def truncated_weights(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """Unnormalised sampling weights of the sampled rows' logits [S, V] fp32 -> [S, V] fp32:
    softmax(logits / temperature) after top-k (ties with the k-th logit kept), top-p (the
    smallest prefix of the sorted probabilities whose mass reaches top_p, at least one token)
    and min-p (p >= min_p * max p) truncation. Rows are in [0, 1], not renormalised."""
    x = (logits / st.temperature[:, None]).clamp(max=FP32_MAX)
    vocab = x.shape[-1]
    if st.any_top_p:  # one sort serves top-k and top-p (vLLM's apply_top_k_top_p)
        x, order = torch.sort(x, dim=-1, descending=True, stable=True)
    elif st.k_max:
        x_top = torch.topk(x, st.k_max, dim=-1).values
    if st.k_max:
        k = st.top_k.clamp(max=x.shape[-1] if st.any_top_p else st.k_max)
        kth = (x if st.any_top_p else x_top).gather(1, (k - 1)[:, None])
        kth = torch.where(st.top_k[:, None] < vocab, kth, float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if st.any_top_p:
        cum = torch.cumsum(probs, dim=-1)
        drop = ((cum - probs) >= st.top_p[:, None]) & (st.top_p[:, None] < 1.0)
        drop[:, 0] = False  # the top token stays even when top_p rounds to 0 in fp32
        probs = probs.masked_fill(drop, 0.0)
    if st.any_min_p:
        top = probs[:, :1] if st.any_top_p else probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < st.min_p[:, None] * top, 0.0)
    if st.any_top_p:
        probs = torch.empty_like(probs).scatter_(1, order, probs)
    return probs


def truncated_probs(logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
    """`truncated_weights` renormalised: the distribution [S, V] each sampled row draws from."""
    w = truncated_weights(logits, st)
    return w / w.sum(-1, keepdim=True)


def draw(weights: torch.Tensor, u: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF draw. weights [S, V] >= 0 (each row some > 0), u [S] in [0, 1), fallback
    [S] int64 -> [S] int64: the first token whose cumulative weight exceeds u * total, so
    token v is drawn with probability weights[v] / total (up to fp32 rounding of the CDF).
    A parallel scan is not guaranteed monotone to the last ulp; a draw that lands on a
    zero-weight token because of it takes `fallback` (the row's argmax) instead."""
    cdf = torch.cumsum(weights, dim=-1)
    total = cdf[:, -1:]
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    tok = torch.searchsorted(cdf, target, right=True).clamp_(max=weights.shape[-1] - 1)
    return torch.where(weights.gather(1, tok) > 0, tok, fallback[:, None]).squeeze(1)


def sample(logits: torch.Tensor, st: SamplingTensors,
           greedy: torch.Tensor | None = None) -> torch.Tensor:
    """One token per row. logits [R, V] (fp32; any float dtype is upcast), `st` built for
    these R rows on logits' device; greedy [R] int64, when given, is logits.argmax(-1)
    computed already (in the graph). Returns int64 [R] on logits' device; no host sync, so it
    captures in a CUDA graph for fixed `st` buffers. Neither `logits` nor `greedy` is written.
    Eager it launches ~40 small kernels (~26 of them the [S] integer hash), which a graph or
    one fused kernel would remove at batch 1."""
    assert logits.shape[0] == st.rows, (logits.shape, st.rows)
    if st.plain_greedy:
        return greedy if greedy is not None else torch.argmax(logits, dim=-1)
    x = logits.float()
    if st.penalty_idx is not None:
        x = x.index_put((st.penalty_idx,), apply_penalties(x[st.penalty_idx], st))
        greedy = None
    tokens = greedy if greedy is not None else torch.argmax(x, dim=-1)
    if st.n_sample == 0:
        return tokens
    idx = st.sample_idx
    xs = x if idx is None else x[idx]
    fallback = tokens if idx is None else tokens[idx]
    drawn = draw(truncated_weights(xs, st), row_uniforms(st.seed, st.position), fallback)
    return drawn if idx is None else tokens.index_put((idx,), drawn)


def sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow],
                greedy: torch.Tensor | None = None) -> list[int]:
    """`sample` for rows described on the host: builds the tensors, samples, and copies the
    R tokens back (the step's one device->host copy). logits [R, V], len(rows) == R."""
    if not rows:
        return []
    st = SamplingTensors.build(rows, logits.shape[-1], logits.device)
    return sample(logits, st, greedy).tolist()
