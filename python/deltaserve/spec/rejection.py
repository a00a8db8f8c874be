"""Exact rejection sampling for argmax (deterministic) drafts.

With a draft distribution that is one-hot on the draft token d_j, the speculative-sampling
acceptance rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023) reduces to: sample the
target token x_j from row j exactly as plain decoding would, accept d_j iff x_j == d_j, and on
the first rejection commit x_j itself. The committed tokens are then distributed exactly as
plain decoding's.

The sampler's draw for a row is a pure function of (seed, output position) and the row's
logits (engine/sampling_rng.py), so every verify row is sampled up front in one batched call
(`verify_rows`) and the rows after the first rejection are simply discarded: their uniforms
decided nothing that is committed, and the next step draws those positions again from new
logits. Given the same logits, a seeded request commits exactly the tokens plain decoding
would, whether or not speculation is on.
"""

from __future__ import annotations

from collections.abc import Sequence

from deltaserve.engine.sampling import SamplingRow


def verify_rows(base: SamplingRow, drafts: Sequence[int], rows: int) -> list[SamplingRow]:
    """The `rows` SamplingRows of one request's verify step (rows >= len(drafts) + 1; row j
    scores the position after draft j-1, row 0 after the pending token). `base` holds the
    request's parameters, prompt, output before this step and seed; row j counts drafts[:j]
    as generated and samples output position len(output) + j. Rows past the real drafts
    (padding) reuse all of them; their tokens are never committed."""
    assert rows >= len(drafts) + 1
    return [SamplingRow(base.params, base.prompt_ids, base.output_ids, base.seed,
                        drafts[:j]) for j in range(rows)]


def accept(targets: Sequence[int], drafts: Sequence[int]) -> list[int]:
    """Tokens to commit, given the sampled target token of each verify row.

    targets: rows 0..len(drafts) (at least len(drafts) + 1 of them), each sampled as
    `verify_rows` describes. Returns 1..len(drafts)+1 tokens: the accepted drafts followed by
    the first target that differs from its draft (or the bonus target after all drafts).
    """
    assert len(targets) >= len(drafts) + 1
    out: list[int] = []
    for j in range(len(drafts) + 1):
        out.append(targets[j])
        if j == len(drafts) or targets[j] != drafts[j]:
            break
    return out
