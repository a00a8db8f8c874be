"""Greedy acceptance on the device: one device->host copy per verify step.

For a plain-greedy request (no penalties) the token of verify row j is the argmax of that row
alone, so the whole acceptance is a comparison of the drafts with the rows' argmax: the number
of leading drafts equal to their row's argmax is a, and the request commits the argmax of rows
0..a (the accepted drafts, then the first disagreeing target or the bonus token). This is
`rejection.accept` over argmax targets (Leviathan et al. 2023, Algorithm 1, at
temperature 0), computed for every request at once.
"""

from __future__ import annotations

import torch


def accept_greedy_rows(greedy: torch.Tensor, drafts: torch.Tensor,
                       num_drafts: torch.Tensor | None = None) -> torch.Tensor:
    """Accepted drafts per request, on the device.

    greedy int64 [N * (k+1)] (or [N, k+1]): the argmax of each verify row; drafts int64 [N, k];
    num_drafts int64 [N] (None: all k are real): drafts past it pad the rows and are never
    accepted. Returns int64 [N] in 0..num_drafts: request i commits greedy[i, :a_i + 1].
    """
    n, k = drafts.shape
    targets = greedy.view(n, k + 1)
    match = drafts == targets[:, :k]
    if num_drafts is not None:
        match &= torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]
    return match.long().cumprod(dim=1).sum(dim=1)


def pack_greedy(greedy: torch.Tensor, drafts: torch.Tensor,
                num_drafts: torch.Tensor | None = None) -> torch.Tensor:
    """The greedy acceptance packed for one copy to the host: int64 [N, k+2], per request
    [a, the targets of rows 0..k] (`accept_greedy_rows`' arguments); request i commits
    row[1:row[0] + 2]. A verify CUDA graph computes it in the graph."""
    n = drafts.shape[0]
    accepted = accept_greedy_rows(greedy, drafts, num_drafts)
    return torch.cat([accepted[:, None], greedy.view(n, -1)], dim=1)
