"""Log-probabilities of the committed tokens, from the logits rows that produced them.

A token's logprob is the log-softmax of the model logits of its row (fp32, before penalties,
temperature and truncation, as vLLM's default `logprobs_mode="raw_logprobs"`), after the
grammar's token mask when the request has one (disallowed tokens then have logprob -inf): the
logits the sampler drew from. Under speculation the row of a verify
step's j-th committed token is its j-th verify row: the same logits the sampler drew it from.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from deltaserve.core import Req


@dataclass(slots=True)
class TokenLogprob:
    """One committed token: its id, its logprob (natural log, <= 0) and the `top` most likely
    tokens of its row as (token id, logprob) pairs, most likely first (ties: lower id first,
    as torch.topk on CPU)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


def row_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[TokenLogprob]:
    """logits [R, V] (any float dtype, any device), tokens: R ids, n_top >= 0 -> R entries.

    One log-softmax in fp32 over each row; one device-to-host copy for all rows.
    """
    assert logits.shape[0] == len(tokens) and n_top >= 0
    lp = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(tokens, dtype=torch.long, device=lp.device)
    chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
    if n_top:
        top = torch.topk(lp, min(n_top, lp.shape[-1]), dim=-1)
        top_vals, top_ids = top.values.tolist(), top.indices.tolist()
    else:
        top_vals = top_ids = [[] for _ in tokens]
    return [TokenLogprob(t, c, list(zip(i, v)))
            for t, c, i, v in zip(tokens, chosen, top_ids, top_vals)]


def step_logprobs(logits: torch.Tensor, owners: list[Req],
                  new_ids: dict[int, list[int]]) -> dict[int, list[TokenLogprob]]:
    """Logprobs of each request's tokens committed in this step.

    logits [M, V]: the step's sampled rows; owners[i] the request of row i (a verify step
    lists each request k+1 times, its rows in order). new_ids[rid]: the tokens the request
    committed in this step, in order; token j came from the request's j-th row. Only requests
    whose `params.logprobs` is set are computed. Returns rid -> entries (one per new token).
    """
    rows: dict[int, list[int]] = {}
    for i, req in enumerate(owners):
        if req.params.logprobs is not None and new_ids.get(req.rid):
            rows.setdefault(req.rid, []).append(i)
    out = {}
    by_rid = {req.rid: req for req in owners}
    for rid, idx in rows.items():
        tokens = new_ids[rid]
        assert len(tokens) <= len(idx), "more committed tokens than rows"
        sel = logits[torch.tensor(idx[:len(tokens)], device=logits.device)]
        out[rid] = row_logprobs(sel, tokens, by_rid[rid].params.logprobs)
    return out
