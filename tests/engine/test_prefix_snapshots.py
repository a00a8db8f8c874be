"""Snapshots at prefill chunk ends: a conversation cut far back resumes from the deepest snapshot
at or below the cut, with the tokens of a cold run (cache off) and of transformers.

CPU, fp32, a tiny checkpoint whose GDN heads decay slowly, so a stale or misplaced state
changes the tokens. The snapshot grid is G = lcm(64, page_size).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from drained import assert_drained
from oracle import assert_same_greedy, reference_greedy
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return slow_decay_checkpoint(tmp_path_factory.mktemp("snap") / "m", seed=4)


def make(ckpt: str, page_size: int = 16, chunk_size: int = 64, **kw) -> LLM:
    return LLM(ckpt, device="cpu", dtype="float32", num_pages=4096 // page_size + 64,
               page_size=page_size, chunk_size=chunk_size, **kw)


def cold(ckpt: str, prompt: list[int]) -> list[int]:
    return make(ckpt, enable_prefix_cache=False).generate([prompt], GREEDY)[0].token_ids


def device_snapshot_depths(llm: LLM) -> list[int]:
    return sorted(n.depth for n in llm.engine.prefix_cache.tree.nodes()
                  if n.snapshot_slot is not None)


@pytest.mark.parametrize(("page_size", "chunk_size", "depths"), [
    (16, 64, [64, 128, 192, 256]),  # one snapshot per chunk end, 256 = the last boundary
    (1, 64, [64, 128, 192, 256]),
    (64, 64, [64, 128, 192, 256]),
    (16, 96, [64, 128, 192, 256]),  # 96 is not on the grid: chunk ends round down to 64s
    (16, 48, [64, 128, 192, 256]),  # 0-48, 48-64, 64-112, 112-128, ...: ends land on the grid
    (16, 128, [128, 256]),
    (128, 64, [128, 256]),  # G = 128: the 64-token chunks that end at 64 and 192 are not on it
])
def test_a_conversation_cut_inside_chunk_three_resumes_from_the_deepest_snapshot_below_it(
        ckpt, page_size, chunk_size, depths):
    first = tokens(300, seed=1)  # five 64-token chunks: 0-64-128-192-256-300
    llm = make(ckpt, page_size, chunk_size)
    (a,) = llm.generate([first], GREEDY)
    assert a.cached_tokens == 0
    assert device_snapshot_depths(llm) == depths
    replay = first[:170] + tokens(20, seed=2)  # cut inside chunk 3 (128..192), a new message
    (b,) = llm.generate([replay], GREEDY)
    assert b.cached_tokens == 128
    assert b.token_ids == cold(ckpt, replay)
    assert_same_greedy(b.token_ids, reference_greedy(ckpt, replay, GREEDY.max_tokens),
                       "cut replay")
    assert_drained(llm.engine)


def test_prompts_of_exactly_64n_tokens_and_matches_leaving_a_one_token_tail(ckpt):
    base = tokens(256, seed=3)
    llm = make(ckpt)
    (a,) = llm.generate([base], GREEDY)
    assert device_snapshot_depths(llm) == [64, 128, 192, 256]
    # an identical resend recomputes its last token: the deepest usable snapshot is 192
    (again,) = llm.generate([base], GREEDY)
    assert again.cached_tokens == 192 and again.token_ids == a.token_ids == cold(ckpt, base)
    for cut in (129, 193, 257):  # each leaves exactly one token after a snapshot
        prompt = (base + tokens(1, seed=4))[:cut]
        (out,) = llm.generate([prompt], GREEDY)
        assert out.cached_tokens == cut - 1, cut
        assert out.token_ids == cold(ckpt, prompt), cut
    assert_drained(llm.engine)


@pytest.mark.parametrize(("fork", "lookahead", "expected"), [
    (192, False, 192),  # on the grid: the shared chunk snapshot at 192
    (176, False, 128),  # on a page boundary off the grid: the snapshot below it
    (192, True, 128),  # lookahead keys match one position short of the fork: 191 -> 128
])
def test_a_fork_on_a_page_boundary_resumes_from_the_deepest_snapshot_before_it(
        ckpt, fork, lookahead, expected):
    shared = tokens(fork, seed=5)
    one, two = shared + tokens(110, seed=6), shared + tokens(40, seed=7)
    llm = make(ckpt, radix_lookahead=lookahead)
    llm.generate([one], GREEDY)
    (out,) = llm.generate([two], GREEDY)
    assert out.cached_tokens == expected
    assert out.token_ids == cold(ckpt, two)
    assert_drained(llm.engine)


def test_a_prompt_with_more_chunk_ends_than_the_cap_keeps_them_evenly_spread(ckpt):
    prompt = tokens(600, seed=8)  # 9 grid boundaries, cap 2: at least 64 * ceil(9/2) apart
    llm = make(ckpt, max_prompt_snapshots=2)
    assert llm.engine.scheduler.snaps.interval(len(prompt)) == 320
    llm.generate([prompt], GREEDY)
    assert device_snapshot_depths(llm) == [320, 576]  # one chunk snapshot, the last boundary
    replay = prompt[:400] + tokens(10, seed=9)
    (out,) = llm.generate([replay], GREEDY)
    assert out.cached_tokens == 320
    assert out.token_ids == cold(ckpt, replay)
    assert_drained(llm.engine)


def test_no_chunk_snapshots_when_the_cap_is_zero(ckpt):
    llm = make(ckpt, max_prompt_snapshots=0)
    llm.generate([tokens(300, seed=10)], GREEDY)
    assert device_snapshot_depths(llm) == [256]
    assert_drained(llm.engine)


def test_admission_short_of_slots_takes_chunk_snapshots_back_and_outputs_stay_exact(ckpt):
    # 1 + 2 x 2 + 0 slots: two running requests each need a live and a track slot
    llm = make(ckpt, max_running_reqs=2, num_snapshot_slots=0)
    eng = llm.engine
    first, second = tokens(600, seed=11), tokens(200, seed=12)
    rid = eng.add_request(first, GREEDY)
    for _ in range(3):  # chunk ends 64 and 128 take the two free slots, 192 finds none
        eng.step()
    assert eng.cache_status()["slots_free"] == 0
    assert eng.cache_status()["chunk_snapshots_skipped"] == 1
    eng.add_request(second, GREEDY)
    out: dict[int, list[int]] = {}
    while eng.has_unfinished():
        for o in eng.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
    assert out[rid] == cold(ckpt, first)
    assert out[rid + 1] == cold(ckpt, second)
    assert 64 not in device_snapshot_depths(llm)  # taken back for the second request
    assert_drained(eng)


def test_a_snapshot_restored_from_a_small_host_bank_is_bitwise_the_device_one(ckpt):
    # 6 device slots: the first prompt's prefill holds 5 (live, track, 3 chunk snapshots);
    # the second prompt's prefill then moves three of its four snapshots to the 3-slot bank
    llm = make(ckpt, max_running_reqs=1, num_snapshot_slots=4, host_snapshot_slots=3)
    eng = llm.engine
    cache, pool, bank = eng.prefix_cache, eng.state_pool, eng.host_bank
    first = tokens(300, seed=14)
    llm.generate([first], GREEDY)
    saved = {n.depth: (n, pool.recurrent[:, n.snapshot_slot].clone(),
                       pool.conv[:, n.snapshot_slot].clone())
             for n in cache.tree.nodes() if n.snapshot_slot is not None}
    assert sorted(saved) == [64, 128, 192, 256]
    llm.generate([tokens(300, seed=15)], GREEDY)
    bank.synchronize()
    moved = sorted(d for d, (node, _, _) in saved.items() if node.host_slot is not None)
    status = eng.cache_status()
    assert moved == [128, 192, 256] and status["host_slots_used"] == status["host_slots_total"]
    assert status["host_bytes_used"] == 3 * status["slot_bytes"] == status["host_bytes_total"]
    for depth in moved:
        node, recurrent, conv = saved[depth]
        assert torch.equal(bank.recurrent[:, node.host_slot], recurrent), depth
        assert torch.equal(bank.conv[:, node.host_slot], conv), depth
    replay = first[:200] + tokens(10, seed=16)
    match = cache.match(replay)
    assert match.cached_len == 192 and match.host_slot is not None
    cache.lock(match.node)
    slot = pool.allocate()
    cache.restore(match, slot)  # what admission does
    assert torch.equal(pool.recurrent[:, slot], saved[192][1])
    assert torch.equal(pool.conv[:, slot], saved[192][2])
    pool.free(slot)
    cache.unlock(match.node)
    (out,) = llm.generate([replay], GREEDY)
    assert out.cached_tokens == 192
    assert out.token_ids == cold(ckpt, replay)
    assert_drained(eng)


def test_an_aborted_request_frees_its_chunk_snapshots(ckpt):
    llm = make(ckpt)
    eng = llm.engine
    rid = eng.add_request(tokens(400, seed=13), GREEDY)
    for _ in range(4):
        eng.step()
    assert eng.cache_status()["chunk_snapshots_taken"] == 4
    assert eng.abort(rid)
    assert eng.prefix_cache.stats().n_snapshots == 0  # nothing of an aborted prompt is cached
    assert_drained(eng)


def test_the_step_log_line_reports_slots_in_use_on_device_and_in_the_host_bank(ckpt, caplog):
    llm = make(ckpt, max_running_reqs=1, num_snapshot_slots=1, host_snapshot_slots=2,
               log_every=1)
    with caplog.at_level("INFO", logger="deltaserve.engine"):
        for seed in (17, 18):
            llm.generate([tokens(150, seed=seed)], GREEDY)
    lines = [r.getMessage() for r in caplog.records if "#host-slots" in r.getMessage()]
    assert "#slots 3/3 used on device" in lines[0] and "#host-slots 0/2 used" in lines[0]
    assert "#host-slots 2/2 used" in lines[-1]  # the first prompt's 64 and 128 moved out
    assert_drained(llm.engine)


def test_chunk_snapshots_go_straight_to_the_host_bank_when_no_device_slot_can_be_had(ckpt):
    # 1 running request, no snapshot slots: the pool is live + track slots only, so during
    # the first prompt's prefill nothing on the device is free or evictable. Before, its chunk
    # snapshots were skipped and a cut far back resumed from (almost) nothing; now they are
    # stored from the live slot into the bank (chunk 64, page 16, grid 64).
    llm = make(ckpt, max_running_reqs=1, num_snapshot_slots=0, host_snapshot_slots=8)
    eng = llm.engine
    first = tokens(600, seed=21)
    (out,) = llm.generate([first], GREEDY)
    status = eng.cache_status()
    assert status["chunk_snapshots_to_host"] == 8 and status["chunk_snapshots_skipped"] == 0
    assert status["host_slots_snapshot"] == 8 and status["host_slots_used"] == 8
    cut = first[:420] + tokens(12, seed=22)
    (resumed,) = llm.generate([cut], GREEDY)
    assert resumed.cached_tokens == 384  # the deepest grid depth at or below the cut
    assert resumed.token_ids == cold(ckpt, cut)
    assert_drained(llm.engine)


def test_host_chunk_snapshots_of_an_aborted_request_go_back_to_the_bank(ckpt):
    llm = make(ckpt, max_running_reqs=1, num_snapshot_slots=0, host_snapshot_slots=8)
    eng = llm.engine
    rid = eng.add_request(tokens(600, seed=23), GREEDY)
    while eng.prefix_cache.host_usage().n_used < 3:
        eng.step()
    assert eng.abort(rid)
    assert eng.prefix_cache.host_usage().n_used == 0
    assert_drained(eng)
