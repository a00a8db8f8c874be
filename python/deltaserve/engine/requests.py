"""Building a checked request: the engine's input checks, its seed and grammar."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from deltaserve.core import Req, SamplingParams
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.engine.sampling import has_penalties

if TYPE_CHECKING:
    from deltaserve.engine.grammar import GrammarBackend
    from deltaserve.engine.healing import TokenHealer


def new_req(prompt_ids: list[int], params: SamplingParams, rid: int, vocab: int,
            max_model_len: int, tokenizer, grammar: Callable[[], GrammarBackend],
            healer: Callable[[], TokenHealer | None] | None = None) -> Req:
    """A checked WAITING request (its sampling seed set, its grammar matcher compiled, its
    prompt healed when `params.token_healing` and `healer` gives the tokenizer's table).

    The seed is `params.seed`, or for an unseeded request one drawn here from torch's global
    CPU generator (seeded by the engine's --seed), so every request samples from its own
    counter-based stream (engine/sampling_rng.py).

    Raises ValueError for bad parameters (stop token ids outside [0, vocab) too) or a prompt
    that is empty, has ids outside [0, vocab) or leaves no room within `max_model_len`.
    """
    params.validate()
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    # bool is an int subclass: [True, False] is a mistake, not the ids [1, 0]. The checks run
    # at C speed (a generator over the ids took 1.9 ms of an 8.5k-token follow-up's TTFT)
    types = set(map(type, prompt_ids))
    if any(not issubclass(tp, int) or issubclass(tp, bool) for tp in types) \
            or min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
        raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")
    if len(prompt_ids) >= max_model_len:
        n = len(prompt_ids)
        raise ValueError(f"the prompt has {n} token{'s' if n != 1 else ''} but the context "
                         f"length is {max_model_len}: at most {max_model_len - 1} prompt "
                         "tokens fit")
    table = healer() if params.token_healing and healer is not None else None
    healing = table.heal(prompt_ids) if table is not None else None
    if healing is not None:  # the first output token re-generates the last prompt token
        prompt_ids = healing.prompt_ids
    # room for the healing tokens that re-generate the removed text (at most a token a byte),
    # which max_tokens does not count (Req.output_budget)
    extra = len(healing.removed) if healing is not None else 0
    max_len = min(len(prompt_ids) + params.max_tokens + extra, max_model_len)
    req = Req(rid=rid, prompt_ids=list(prompt_ids), params=params, max_len=max_len,
              arrival_time=time.monotonic(), healing=healing)
    req.sample_seed = params.seed if params.seed is not None \
        else int(torch.randint(-2**63, 2**63 - 1, ()))
    if params.structured is not None:
        req.grammar = grammar().matcher(params.structured)
    req.detok = IncrementalDetokenizer(tokenizer, list(params.stop),
                                       healing.removed_text if healing else "")
    return req


def overlappable(req: Req) -> bool:
    """Whether `req`'s next decode row needs nothing on the host derived from the token before
    it: no grammar mask, no token-healing mask, no logprobs (read from the graph's logits,
    which the next replay overwrites), no penalties (they count the output ids)."""
    return (req.grammar is None and req.params.logprobs is None
            and not has_penalties(req.params)
            and not req.healing_pending())
