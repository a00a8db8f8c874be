"""A long prompt read in chunk by chunk must not stall the requests already decoding: prefill
and decode batches take turns (a fresh user's finding: a 32k-token prompt froze every stream
for 26 s on CPU while its chunks ran back to back)."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.core import Phase
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "ngram",
                                        "speculative_num_steps": 2},
                                   {"speculative_algorithm": "mtp", "speculative_num_steps": 2}])
def test_decoding_requests_advance_between_the_chunks_of_a_long_prompt(tmp_path, spec):
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    kw = dict(device="cpu", dtype="float32", chunk_size=64, max_num_batched_tokens=64,
              page_size=16, **spec)
    engine = LLM(path, **kw).engine
    phases = []
    schedule = engine.scheduler.schedule

    def recording_schedule():
        batch = schedule()
        phases.append(None if batch is None else batch.phase)
        return batch

    engine.scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    short_prompt, long_prompt = [5, 6, 7], [(7 * i) % 400 + 3 for i in range(640)]
    short = engine.add_request(short_prompt, params)
    tokens = {short: []}
    while not tokens[short]:  # the short prompt's one prefill chunk and its first token
        for out in engine.step():
            tokens[out.rid].extend(out.new_token_ids)
    long = engine.add_request(long_prompt, params)
    tokens[long] = []
    phases.clear()
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.rid].extend(out.new_token_ids)
    # the long prompt's 10 chunks, a step of the short request (still decoding then: 40
    # tokens, at most 3 a step) between every two of them
    # (with speculation the adaptive policy runs verify or plain decode steps)
    decode = {Phase.VERIFY, Phase.DECODE} if spec else {Phase.DECODE}
    last = max(i for i, phase in enumerate(phases) if phase is Phase.PREFILL)
    turns = phases[:last + 1]
    assert turns.count(Phase.PREFILL) == 10 and set(turns) - {Phase.PREFILL} <= decode
    assert set(turns) != {Phase.PREFILL}
    assert all((a is Phase.PREFILL) != (b is Phase.PREFILL) for a, b in zip(turns, turns[1:]))
    alone = LLM(path, **kw)
    for rid, prompt in ((short, short_prompt), (long, long_prompt)):
        (ref,) = alone.generate([prompt], params)
        assert tokens[rid] == ref.token_ids
    assert_drained(engine)
