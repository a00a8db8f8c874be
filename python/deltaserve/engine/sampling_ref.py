"""Row-by-row reference of the batched sampler (engine/sampling.py): the oracle of its tests.

Not on the serving path. One row at a time, in the order and with the arithmetic vLLM's
sampler uses: penalties (repetition as in CTRL, Keskar et al. 2019, eq. 2; presence/frequency
as in the OpenAI API), then temperature, then top-k / top-p / min-p truncation of the softmax,
then one inverse-CDF draw with the row's counter-based uniform (engine/sampling_rng.py).
"""

from __future__ import annotations

import torch

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import FP32_MAX, SamplingRow
from deltaserve.engine.sampling_rng import uniform_int


def apply_penalties_ref(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Penalised copy of one row of logits [V] (fp32); returns `logits` itself when none
    apply. Ids >= V in the prompt or output are ignored."""
    p = row.params
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    generated = list(row.output_ids) + list(row.drafts)
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(generated)),
                            dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        # a penalty near 0 (1e-300 is 0 in fp32) would divide positive logits to inf, and one
        # inf makes the softmax NaN: the largest finite float keeps such a token the top one
        logits[seen] = torch.where(vals > 0, (vals / p.repetition_penalty).clamp(max=FP32_MAX),
                                   vals * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and generated:
        ids = torch.tensor(generated, dtype=torch.long, device=logits.device)
        ids = ids[ids < vocab]
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncated_probs_ref(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of logits [V] / temperature after top-k, top-p and min-p truncation -> probs [V]
    (fp32, sums to 1). top-k keeps ties with the k-th logit; top-p keeps the smallest prefix
    of the sorted probabilities whose mass reaches top_p (at least one token)."""
    logits = (logits / params.temperature).clamp(max=FP32_MAX)  # inf would give NaN (above)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop_sorted[0] = False  # even when top_p rounds to 0 in fp32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_row_ref(logits: torch.Tensor, row: SamplingRow) -> int:
    """One row's token: argmax of the penalised logits [V] for a greedy row (ties: lowest id),
    else the inverse-CDF draw with the row's uniform u: the first token whose cumulative
    probability exceeds u (float64 here; the batched sampler's fp32 CDF can differ from it
    only when u lies within rounding of a CDF step)."""
    penalised = apply_penalties_ref(logits.float(), row)
    if row.params.greedy:
        return int(torch.argmax(penalised))
    probs = truncated_probs_ref(penalised, row.params).double()
    cdf = torch.cumsum(probs, 0)
    u = uniform_int(row.seed, row.position)
    idx = int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64),
                                 right=True))
    return min(idx, int(torch.nonzero(probs).max()))


def sample_rows_ref(logits: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
    """`sample_row_ref` for each row of logits [R, V]."""
    return [sample_row_ref(logits[i], row) for i, row in enumerate(rows)]
