"""Random sampling rows and logits for the batched-sampler tests (fixed seeds)."""

from __future__ import annotations

import math
import random

import torch

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import (
    SamplingRow,
    SamplingTensors,
    apply_penalties,
    truncated_probs,
)


def random_params(rng: random.Random, vocab: int, greedy_share: float = 0.2) -> SamplingParams:
    """Mixed per-row parameters: every truncation and penalty on or off at random."""
    if rng.random() < greedy_share:
        return SamplingParams(temperature=0.0 if rng.random() < 0.5 else 0.7, top_k=1,
                              repetition_penalty=rng.choice([1.0, 1.3]))
    return SamplingParams(
        temperature=rng.choice([0.3, 0.7, 1.0, 1.5]),
        top_k=rng.choice([-1, 0, 2, 5, vocab - 1, vocab, vocab + 3]),
        top_p=rng.choice([1.0, 1.0, 0.9, 0.5, 0.05]),
        min_p=rng.choice([0.0, 0.0, 0.05, 0.3]),
        repetition_penalty=rng.choice([1.0, 1.0, 0.8, 1.2, 2.0]),
        presence_penalty=rng.choice([0.0, 0.0, 0.5, -1.0]),
        frequency_penalty=rng.choice([0.0, 0.0, 0.3, -0.2]))


def random_row(rng: random.Random, vocab: int, params: SamplingParams | None = None,
               seed: int | None = None) -> SamplingRow:
    """A row with random prompt/output/draft ids (some >= vocab, which penalties ignore)."""
    ids = lambda n: [rng.randrange(vocab + 2) for _ in range(n)]  # noqa: E731
    return SamplingRow(params or random_params(rng, vocab), ids(rng.randint(1, 12)),
                       ids(rng.randint(0, 12)),
                       rng.randrange(-2**63, 2**64) if seed is None else seed,
                       ids(rng.choice([0, 0, 1, 3])))


def batched_probs(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """The distribution [R, V] the batched sampler draws each row from (every row non-greedy):
    its penalties and truncation, in the order `sample` applies them."""
    st = SamplingTensors.build(rows, logits.shape[-1], logits.device)
    x = logits.float().clone()
    if st.penalty_idx is not None:
        x[st.penalty_idx] = apply_penalties(x[st.penalty_idx], st)
    return truncated_probs(x if st.sample_idx is None else x[st.sample_idx], st)


def chi2_critical(df: int, z: float = 3.09) -> float:
    """Chi-square critical value at p = 0.001 (z = 3.09), Wilson-Hilferty approximation: a
    few percent above the exact value (df 1: 11.15 for 10.83; df 5: 20.75 for 20.52)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """(statistic, degrees of freedom) of counts [V] against probs [V], over the support."""
    keep = probs > 0
    expected = probs[keep].double() * counts.sum()
    stat = float(((counts[keep].double() - expected) ** 2 / expected).sum())
    return stat, int(keep.sum()) - 1
