"""Reproducible random prompts for the tests."""

from __future__ import annotations

import random


def random_tokens(n: int, seed: int, vocab: int = 500) -> list[int]:
    """`n` token ids drawn uniformly from [0, vocab) by a generator seeded with `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(vocab) for _ in range(n)]
