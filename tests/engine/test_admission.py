"""Admission with very few GDN state slots: the matched path may hold every snapshot slot."""

from __future__ import annotations

import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained


def test_a_request_is_admitted_when_its_locked_match_holds_every_snapshot_slot(tmp_path):
    # 1 live slot + 2 x 1 track slots + 1 snapshot slot: after the first prompt the cache
    # holds snapshots whose path the next match locks, so a request needing a live slot
    # and a track slot finds neither free nor evictable, with nothing running to free one.
    # Found by a fresh user (server spun for ever at 100% CPU); chunk 256, page 16.
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    llm = LLM(str(path), device="cpu", dtype="float32", max_running_reqs=1,
              num_snapshot_slots=1, host_snapshot_slots=4, chunk_size=256, page_size=16,
              num_pages=512)
    rng = random.Random(0)
    text = [rng.randrange(500) for _ in range(1645)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    cold = LLM(str(path), device="cpu", dtype="float32", enable_prefix_cache=False)
    for n in (1645, 285, 515, 772, 1133, 772):
        (out,) = llm.generate([text[:n]], params)
        (ref,) = cold.generate([text[:n]], params)
        assert out.token_ids == ref.token_ids, n
        assert out.cached_tokens % 64 == 0 and out.cached_tokens < n
    assert_drained(llm.engine)


def test_max_request_len_is_what_the_page_pool_can_hold_when_it_is_below_the_context(tmp_path):
    # 20 pages of 16 tokens, page 0 reserved: 304 token positions; a verify step (k = 3)
    # writes 3 positions past the request's length, so 301 with speculation.
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    small = LLM(path, device="cpu", dtype="float32", page_size=16, num_pages=20,
                max_model_len=512)
    assert small.engine.max_request_len == 304
    spec = LLM(path, device="cpu", dtype="float32", page_size=16, num_pages=20,
               max_model_len=512, speculative_algorithm="ngram", speculative_num_steps=3)
    assert spec.engine.max_request_len == 301
    roomy = LLM(path, device="cpu", dtype="float32", page_size=16, num_pages=200,
                max_model_len=512)
    assert roomy.engine.max_request_len == 512
    params = SamplingParams(temperature=0.0, max_tokens=304 - 10, ignore_eos=True)
    (out,) = small.generate([list(range(3, 13))], params)  # exactly fills the pool
    assert len(out.token_ids) == 294
    assert_drained(small.engine)


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "ngram",
                                        "speculative_num_steps": 3}])
def test_a_request_too_long_for_the_pool_is_refused_naming_the_verify_rows_it_needs(tmp_path, spec):
    """7 usable pages of 16 tokens hold 112 positions; a speculative request also needs its k
    verify rows past max_tokens, and the error has to add up to the pages it names."""
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    engine = LLM(path, device="cpu", dtype="float32", num_pages=8, page_size=16, **spec).engine
    rows = spec.get("speculative_num_steps", 0)
    fits = SamplingParams(temperature=0.0, max_tokens=112 - 1 - rows, ignore_eos=True)
    assert engine.abort(engine.add_request([5], fits))
    over = SamplingParams(temperature=0.0, max_tokens=112 - rows, ignore_eos=True)
    with pytest.raises(ValueError) as e:
        engine.add_request([5], over)
    says = str(e.value)
    assert "needs 8 KV pages of 16 tokens" in says and "the pool has 7" in says
    # the first word is the request field the server names as the error's param
    assert says.startswith(f"max_tokens {112 - rows} does not fit the KV pool")
    assert (f"+ {rows} speculative verify rows" in says) == bool(rows)


@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "ngram",
                                        "speculative_num_steps": 3}])
def test_a_prompt_too_long_for_the_pool_is_refused_naming_the_prompt(tmp_path, spec):
    """With one output token a prompt of 112 - rows tokens fills the 7 usable pages of 16; one
    more token can fit no max_tokens, so the error blames the prompt, not max_tokens (a fresh
    user's finding: the server named max_tokens as the param)."""
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    engine = LLM(path, device="cpu", dtype="float32", num_pages=8, page_size=16, **spec).engine
    rows = spec.get("speculative_num_steps", 0)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    assert engine.abort(engine.add_request([5] * (111 - rows), one))
    with pytest.raises(ValueError) as e:
        engine.add_request([5] * (112 - rows), one)
    says = str(e.value)
    assert says.startswith(f"prompt of {112 - rows} tokens does not fit the KV pool")
    assert "needs 8 KV pages of 16 tokens" in says and "the pool has 7" in says
    assert engine.scheduler.page_pool.num_free == 7


def test_cache_status_reports_the_pages_running_requests_are_promised_but_do_not_hold(tmp_path):
    """Admission reserves a request's prompt + max_tokens up front; pages_free alone then does
    not say why requests wait (found by a fresh-user run)."""
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    engine = LLM(path, device="cpu", dtype="float32", page_size=16, num_pages=64).engine
    rid = engine.add_request(list(range(3, 23)), SamplingParams(temperature=0.0, max_tokens=100,
                                                                ignore_eos=True))
    assert engine.cache_status()["pages_reserved"] == 0  # waiting: nothing promised yet
    engine.step()  # admitted: the 20-token prompt's 2 pages taken, 120 tokens' 8 promised
    status = engine.cache_status()
    assert status["running_requests"] == 1
    assert status["pages_reserved"] == 8 - (status["pages_total"] - status["pages_free"])
    assert status["pages_reserved"] > 0
    assert engine.abort(rid)
    assert engine.cache_status()["pages_reserved"] == 0
    assert_drained(engine)


def test_a_pool_smaller_than_the_context_is_logged_at_startup(tmp_path, caplog):
    """7 usable pages of 16 tokens hold 112 of the tiny model's context (a fresh user's finding:
    nothing said so until a long request was refused)."""
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    with caplog.at_level("WARNING", logger="deltaserve.engine"):
        small = LLM(path, device="cpu", dtype="float32", num_pages=8, page_size=16)
    assert small.engine.max_request_len == 112
    assert ("the longest request the KV page pool can hold is 112 tokens, less than the "
            "context length") in caplog.text and "raise --num-pages" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="deltaserve.engine"):
        LLM(path, device="cpu", dtype="float32", num_pages=8, page_size=16, max_model_len=100)
    assert "KV page pool" not in caplog.text


def test_a_pool_that_cannot_hold_a_two_token_request_is_refused_at_startup(tmp_path):
    """One usable page of one token, less the 3 verify rows: no request could ever run."""
    path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0))
    with pytest.raises(ValueError, match="cannot hold even a 2-token request"):
        LLM(path, device="cpu", dtype="float32", num_pages=2, page_size=1,
            speculative_algorithm="ngram", speculative_num_steps=3)


def test_a_small_snapshot_pool_never_lowers_how_many_requests_run_at_once(tmp_path):
    # 1 + 2 x 4 + 0 slots: each 128-token prompt wants a live slot and track slots at depths
    # 64 and 128. Admission that waited for track slots ran these 4 requests 2 at a time (on
    # the 35B-A3B config, 4 snapshot slots held a batch of 32 at 23). Track snapshots are a
    # cache: a request reserves what is left beside a live slot for each request that could
    # still join, so the first ones keep their depths and the last ones run without.
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    kwargs = dict(device="cpu", dtype="float32", page_size=16, num_pages=128)
    llm = LLM(str(path), max_running_reqs=4, num_snapshot_slots=0, **kwargs)
    cold = LLM(str(path), enable_prefix_cache=False, **kwargs)
    rng = random.Random(1)
    prompts = [[rng.randrange(500) for _ in range(128)] for _ in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    eng = llm.engine
    rids = [eng.add_request(p, params) for p in prompts]
    out: dict[int, list[int]] = {}
    most = 0
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        most = max(most, len(eng.scheduler.running))
    assert most == 4
    for rid, p in zip(rids, prompts):
        assert out[rid] == cold.generate([p], params)[0].token_ids
    # the first request kept its track snapshot at its prompt's end: a follow-up resumes there
    (again,) = llm.generate([prompts[0] + out[rids[0]] + [7]], params)
    assert again.cached_tokens == 128
    assert again.token_ids == cold.generate([prompts[0] + out[rids[0]] + [7]], params)[0].token_ids
    assert_drained(eng)


def test_a_request_that_fits_passes_one_waiting_for_pages_but_never_starves_it(tmp_path):
    # 19 usable pages of 16 tokens: A and B reserve 14 each (16 + 200 tokens), so B waits for
    # A; the small C1..C3 (2 pages each) fit beside A. They may pass B max_running_reqs (2)
    # times while it waits, then the queue waits for B: admission order A, C1, C2, B, C3.
    # (FIFO alone held every small request behind B: n = 128 samples of 32,000 tokens held a
    # 16-token request for minutes, a fresh user's finding.)
    path = make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=0)
    kwargs = dict(device="cpu", dtype="float32", page_size=16, enable_prefix_cache=False)
    llm = LLM(str(path), num_pages=20, max_running_reqs=2, **kwargs)
    cold = LLM(str(path), **kwargs)
    rng = random.Random(2)
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    asks = [(name, [rng.randrange(500) for _ in range(16)], params)
            for name, params in (("A", long), ("B", long), ("C1", short), ("C2", short),
                                 ("C3", short))]
    eng = llm.engine
    names = {eng.add_request(p, params): name for name, p, params in asks}
    order: list[str] = []
    out: dict[str, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(names[o.rid], []).extend(o.new_token_ids)
        order += [names[r.rid] for r in eng.scheduler.running if names[r.rid] not in order]
    assert order == ["A", "C1", "C2", "B", "C3"]
    for name, p, params in asks:
        assert out[name] == cold.generate([p], params)[0].token_ids, name
    assert_drained(eng)
