"""The scheduler's batched commit of a step's tokens (`_commit_tokens`: one extend, the first
finishing token found from the stop ids and the length room) equals committing them one at a
time (`_commit_each`, the rule it replaced) for every mix of eos, stop ids and limits."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from deltaserve.core import Req, SamplingParams
from deltaserve.engine.detokenizer import IncrementalDetokenizer
from deltaserve.scheduler.scheduler import Scheduler


class _Rules:
    """The part of Scheduler the commit reads (eos ids) with its commit methods."""

    _commit_tokens = Scheduler._commit_tokens
    _commit_each = Scheduler._commit_each
    _stop_reason = Scheduler._stop_reason

    def __init__(self, eos: set[int]) -> None:
        self.eos_ids = eos


def running_req(prompt: int, done: int, max_tokens: int, max_len: int, stop_ids: list[int],
                ignore_eos: bool, detok: bool) -> Req:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos,
                            stop_token_ids=stop_ids)
    req = Req(rid=0, prompt_ids=[1] * prompt, params=params, max_len=max_len,
              output_ids=[2] * done)
    req.detok = IncrementalDetokenizer(None, []) if detok else None
    if req.detok is not None:
        req.detok.ids = list(req.output_ids)
    return req


@settings(max_examples=400, deadline=None)
@given(prompt=st.integers(1, 6), done=st.integers(0, 5), room=st.integers(1, 6),
       ctx_room=st.integers(1, 6), tokens=st.lists(st.integers(0, 5), min_size=1, max_size=5),
       eos=st.sets(st.integers(0, 5), max_size=2), stop_ids=st.lists(st.integers(0, 5),
                                                                    max_size=2),
       ignore_eos=st.booleans(), detok=st.booleans())
def test_batched_commit_equals_the_token_by_token_rule(prompt, done, room, ctx_room, tokens,
                                                       eos, stop_ids, ignore_eos, detok):
    kw = dict(prompt=prompt, done=done, max_tokens=done + room,
              max_len=prompt + done + ctx_room, stop_ids=stop_ids, ignore_eos=ignore_eos,
              detok=detok)
    fast, each = running_req(**kw), running_req(**kw)
    rules = _Rules(eos)
    n = rules._commit_tokens(fast, list(tokens))
    assert n == rules._commit_each(each, list(tokens))
    assert fast.output_ids == each.output_ids
    assert (fast.status, fast.finish_reason) == (each.status, each.finish_reason)
    if detok:  # a stop id's text is left out of the detokenizer's ids
        assert fast.detok.ids == each.detok.ids
