"""n choices of one prompt: the prompt is prefilled once (a hidden parent), then each choice
resumes from the prefix cache; each equals a single request with that choice's seed."""

from __future__ import annotations

import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint

PROMPT_LEN = 130  # two 64-token snapshots deep: each choice recomputes 2 prompt tokens


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_tiny_checkpoint(tmp_path_factory.mktemp("forks") / "m", "qwen3_5_text", seed=4)
    return LLM(str(path), device="cpu", dtype="float32", num_pages=256, page_size=16)


def run_all(engine, rids) -> dict[int, list[int]]:
    got = {rid: [] for rid in rids}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.rid in got, "the hidden parent's output must not be reported"
            got[out.rid].extend(out.new_token_ids)
    return got


def test_three_choices_equal_single_requests_and_the_prompt_is_prefilled_once(llm):
    engine = llm.engine
    prompt = [random.Random(0).randrange(200) for _ in range(PROMPT_LEN)]
    params = [SamplingParams(temperature=0.9, seed=11 + i, max_tokens=8, ignore_eos=True)
              for i in range(3)]
    before = engine.cache_status()
    rids = engine.add_forks(prompt, params)
    choices = run_all(engine, rids)
    after = engine.cache_status()
    # the parent, then three choices that each hit the prompt's last 64-token snapshot
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4 * PROMPT_LEN
    assert after["hit_tokens"] - before["hit_tokens"] == 3 * 128
    engine.check_integrity()
    engine.flush_cache()
    singles = [llm.generate([prompt], p)[0].token_ids for p in params]
    assert [choices[r] for r in rids] == singles
    assert len({tuple(s) for s in singles}) == 3  # the seeds differ, so do the choices


def test_aborting_every_held_choice_aborts_the_parent_and_frees_everything(llm):
    engine = llm.engine
    rids = engine.add_forks(list(range(1, PROMPT_LEN + 1)),
                            [SamplingParams(max_tokens=4, seed=i) for i in range(2)])
    engine.step()  # the parent's first prefill chunk
    for rid in rids:
        assert engine.abort(rid)
    assert not engine.has_unfinished()
    engine.check_integrity()


def test_bad_choice_parameters_queue_nothing(llm):
    engine = llm.engine
    with pytest.raises(ValueError, match="temperature"):
        engine.add_forks([1, 2, 3], [SamplingParams(), SamplingParams(temperature=-1.0)])
    assert not engine.has_unfinished()
