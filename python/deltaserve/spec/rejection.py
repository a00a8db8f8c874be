"""Exact rejection sampling for argmax (deterministic) drafts.

With a draft distribution that is one-hot on the draft token d_j, the speculative-sampling
acceptance rule (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023) reduces to: sample the
target token x_j from row j exactly as plain decoding would, accept d_j iff x_j == d_j, and on
the first rejection commit x_j itself. The committed tokens are then distributed exactly as
plain decoding's. Rows are sampled in order and sampling stops at the first rejection, so a
seeded request consumes one random draw per committed token, as plain decoding does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deltaserve.engine.sampling import SamplingRow, sample_rows


def accept_drafts(logits: torch.Tensor, base: SamplingRow, drafts: list[int]) -> list[int]:
    """Tokens to commit for one request's verify rows.

    logits [R, V] fp32 with R >= len(drafts) + 1: row j scores the position after draft j-1
    (row 0 after the pending token). `base` holds the request's parameters, prompt and
    generated ids before this step; row j counts drafts[:j] as generated (penalties).
    Returns 1..len(drafts)+1 tokens: the accepted drafts followed by one target token.
    """
    assert logits.shape[0] >= len(drafts) + 1

    def target(j: int) -> int:  # sampled only when reached: one random draw per token
        row = SamplingRow(base.params, base.prompt_ids, base.generated_ids + drafts[:j],
                          base.generator)
        return sample_rows(logits[j:j + 1], [row])[0]

    return _accept(target, drafts)


def accept_greedy(targets: list[int], drafts: list[int]) -> list[int]:
    """`accept_drafts` for a plain-greedy request (no penalties), given each row's argmax.

    targets: the argmax token of rows 0..len(drafts) (at least len(drafts) + 1 of them).
    Returns the accepted drafts followed by the first target that disagrees (or the bonus
    target after all drafts): the same tokens `accept_drafts` commits for such a request.
    """
    assert len(targets) >= len(drafts) + 1
    return _accept(targets.__getitem__, drafts)


def _accept(target: Callable[[int], int], drafts: list[int]) -> list[int]:
    """Row targets in order, up to and including the first that differs from its draft (or
    the bonus row after all drafts)."""
    out: list[int] = []
    for j in range(len(drafts) + 1):
        token = target(j)
        out.append(token)
        if j == len(drafts) or token != drafts[j]:
            break
    return out
