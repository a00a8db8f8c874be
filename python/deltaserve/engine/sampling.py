"""Token sampling for decode and verify rows: penalties, temperature, top-k, top-p, min-p.

Every row carries its own request's parameters and generator, so a verify step samples each of
its k+1 rows exactly as k+1 decode steps would (the drafts before a row count as generated).
Math follows vLLM's sampler: penalties first (repetition as in CTRL, Keskar et al. 2019, eq. 2;
presence/frequency as in the OpenAI API), then temperature, then top-k / top-p / min-p
truncation of the softmax, then one multinomial draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deltaserve.core import SamplingParams

FP32_MAX = torch.finfo(torch.float32).max


@dataclass(slots=True)
class SamplingRow:
    """What sampling one logits row needs.

    `prompt_ids` and `generated_ids` feed the penalties; for a verify row `generated_ids`
    includes the drafts before that row.
    """

    params: SamplingParams
    prompt_ids: list[int]
    generated_ids: list[int]
    generator: torch.Generator | None


def apply_penalties(logits: torch.Tensor, row: SamplingRow) -> torch.Tensor:
    """Penalised copy of one row of logits [V] (fp32); returns `logits` itself when none apply."""
    p = row.params
    if p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0:
        return logits
    logits = logits.clone()
    vocab = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(row.prompt_ids) | set(row.generated_ids)),
                            dtype=torch.long, device=logits.device)
        seen = seen[seen < vocab]
        vals = logits[seen]
        # a penalty near 0 (1e-300 is 0 in fp32) would divide positive logits to inf, and one
        # inf makes the softmax NaN: the largest finite float keeps such a token the top one
        logits[seen] = torch.where(vals > 0, (vals / p.repetition_penalty).clamp(max=FP32_MAX),
                                   vals * p.repetition_penalty)
    if (p.presence_penalty != 0.0 or p.frequency_penalty != 0.0) and row.generated_ids:
        ids = torch.tensor(row.generated_ids, dtype=torch.long, device=logits.device)
        ids = ids[ids < vocab]
        counts = torch.bincount(ids, minlength=vocab).to(logits.dtype)
        logits -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
    return logits


def truncated_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Softmax of logits [V] / temperature after top-k, top-p and min-p truncation -> probs [V]."""
    logits = (logits / params.temperature).clamp(max=FP32_MAX)  # inf would give NaN (above)
    vocab = logits.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        cum = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (the first token is always kept)
        drop_sorted = (cum - sorted_probs) >= params.top_p
        drop_sorted[0] = False  # even when top_p rounds to 0 in fp32
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
    if params.min_p > 0.0:
        probs = probs.masked_fill(probs < params.min_p * probs.max(), 0.0)
    return probs / probs.sum()


def sample_rows(logits: torch.Tensor, rows: list[SamplingRow],
                greedy: torch.Tensor | None = None) -> list[int]:
    """Sample one token per row. logits [R, V] fp32, len(rows) == R -> R token ids; greedy [R]
    int64 (logits' device), when given, is logits.argmax(-1) computed already (in the graph).

    Greedy rows take the argmax of the penalised logits (ties: lowest id, as torch.argmax).
    Plain-greedy rows (no penalties) are decided by one argmax over every row and one
    device->host copy, no host->device copy. Sampled rows draw with the row's generator (seeded
    per request) on the CPU, so a seeded request gives the same tokens on any device.
    """
    assert logits.shape[0] == len(rows)
    plain_greedy = [i for i, r in enumerate(rows) if is_plain_greedy(r.params)]
    out: list[int] = [0] * len(rows)
    if plain_greedy:
        best = (torch.argmax(logits, dim=-1) if greedy is None else greedy).tolist()
        for i in plain_greedy:
            out[i] = best[i]
    done = set(plain_greedy)
    for i, row in enumerate(rows):
        if i in done:
            continue
        row_logits = apply_penalties(logits[i].float(), row)
        if row.params.greedy:
            out[i] = int(torch.argmax(row_logits))
            continue
        probs = truncated_probs(row_logits, row.params).cpu()
        out[i] = int(torch.multinomial(probs, 1, generator=row.generator))
    return out


def is_plain_greedy(p: SamplingParams) -> bool:
    """Greedy without penalties: a row's token is the argmax of its logits alone (it does not
    depend on the tokens before it), so many rows can be decided by one argmax."""
    return p.greedy and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 \
        and p.frequency_penalty == 0.0
