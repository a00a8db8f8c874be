"""Fork snapshots: requests that share a long prefix and differ after it resume at the deepest
grid boundary of the shared part, from the third request on, with the tokens of cold runs.

CPU, fp32, a tiny checkpoint whose GDN heads decay slowly (a stale or misplaced state changes
the tokens). Default chunk size 2048 and page size 16 (issue 34): grid G = 64. Request 1
caches the shared prefix as KV, but its snapshots (2048 and its last boundary) lie in its own
suffix; request 2 matches nothing usable, sees the cached path run to 1488 (1500 rounded down
to a page) and snapshots 1472 on the way; request 3 on resumes there.
"""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
CHUNK, PAGE = 2048, 16


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return slow_decay_checkpoint(tmp_path_factory.mktemp("fork") / "m", seed=4)


def make(ckpt: str, **kw) -> LLM:
    return LLM(ckpt, device="cpu", dtype="float32", page_size=PAGE, chunk_size=CHUNK,
               num_pages=16 * 2300 // PAGE + 64, **kw)


def prompts(shared_len: int, n: int, unique_len: int = 700, seed: int = 0) -> list[list[int]]:
    shared = tokens(shared_len, seed=seed)
    return [shared + tokens(unique_len, seed=seed + 1000 + i) for i in range(n)]


def cold(ckpt: str, batch: list[list[int]]) -> list[list[int]]:
    outs = make(ckpt, enable_prefix_cache=False).generate(batch, GREEDY)
    return [o.token_ids for o in outs]


def one_after_another(llm: LLM, batch: list[list[int]]) -> tuple[list[int], list[list[int]]]:
    outs = [llm.generate([p], GREEDY)[0] for p in batch]
    return [o.cached_tokens for o in outs], [o.token_ids for o in outs]


def test_sixteen_requests_sharing_1500_tokens_hit_1472_from_the_third_on(ckpt):
    batch = prompts(1500, 16)
    llm = make(ckpt)
    hits, outs = one_after_another(llm, batch)
    assert hits == [0, 0] + [1472] * 14
    assert outs == cold(ckpt, batch)
    status = llm.engine.cache_status()
    assert status["fork_snapshots_taken"] == 1 and status["fork_snapshots_skipped"] == 0
    assert status["hit_tokens"] == 14 * 1472
    assert_drained(llm.engine)


def test_without_fork_snapshots_a_shared_prefix_is_never_hit(ckpt):
    batch = prompts(1500, 3)
    llm = make(ckpt, fork_snapshots=False)
    hits, _ = one_after_another(llm, batch)
    assert hits == [0, 0, 0]  # the symptom: KV cached, no snapshot on the shared part
    assert llm.engine.cache_status()["fork_snapshots_taken"] == 0
    assert_drained(llm.engine)


@pytest.mark.parametrize(("shared_len", "lookahead", "depth"), [
    (1536, False, 1536),  # grid-aligned: the fork lies exactly on a boundary
    (63, False, 0),  # no grid boundary in the shared part: nothing is taken
    (1500, True, 1472),  # lookahead keys (as with MTP): the same depth
    (1536, True, 1472),  # lookahead keys match one position short: 1535 -> page 1520 -> 1472
])
def test_the_fork_snapshot_lies_at_the_deepest_grid_boundary_of_the_shared_part(
        ckpt, shared_len, lookahead, depth):
    batch = prompts(shared_len, 4, seed=7)
    llm = make(ckpt, radix_lookahead=lookahead)
    hits, outs = one_after_another(llm, batch)
    assert hits == [0, 0, depth, depth]
    assert llm.engine.cache_status()["fork_snapshots_taken"] == (1 if depth else 0)
    assert outs == cold(ckpt, batch)
    assert_drained(llm.engine)


def test_with_mtp_and_lookahead_keys_requests_resume_at_the_fork_with_the_plain_tokens(ckpt):
    batch = prompts(1500, 4, seed=9)
    llm = make(ckpt, speculative_algorithm="mtp", speculative_num_steps=2)
    assert llm.engine.cfg.radix_lookahead
    hits, outs = one_after_another(llm, batch)
    assert hits == [0, 0, 1472, 1472]
    assert outs == cold(ckpt, batch)
    assert_drained(llm.engine)


def test_concurrent_requests_admitted_after_the_fork_was_passed_hit_it_before_it_finishes(ckpt):
    # request 1 alone, then 8 sent at once with room for 4 running: 2..5 are admitted before
    # any fork snapshot exists (only request 2 claims it), 6..9 as 3..5 finish, while request
    # 2 (a long answer) still decodes: its fork snapshot is in the tree since its first chunk
    batch = prompts(1500, 9, seed=11)
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    llm = make(ckpt, max_running_reqs=4)
    eng = llm.engine
    first = llm.generate([batch[0]], GREEDY)[0]
    assert first.cached_tokens == 0
    rids = [eng.add_request(p, long if i == 0 else GREEDY) for i, p in enumerate(batch[1:])]
    admitted: dict[int, int] = {}  # rid -> step it was admitted in
    cached: dict[int, int] = {}
    passed = None  # the step in which request 2's prefill passed 1472
    running_at_admission: dict[int, bool] = {}
    out: dict[int, list[int]] = {}
    step = 0
    while eng.has_unfinished():
        step += 1
        for o in eng.step():
            out.setdefault(o.rid, []).extend(o.new_token_ids)
        running = {r.rid: r for r in eng.scheduler.running}
        for rid, req in running.items():
            if rid not in admitted:
                admitted[rid], cached[rid] = step, req.cached_len
                running_at_admission[rid] = rids[0] in running
        if passed is None and rids[0] in running and running[rids[0]].device_len >= 1472:
            passed = step
    assert passed is not None
    for rid in rids:
        assert cached[rid] == (1472 if admitted[rid] > passed else 0), (rid, admitted, passed)
    assert [cached[r] for r in rids] == [0] * 4 + [1472] * 4
    assert all(running_at_admission[r] for r in rids[4:7])  # hit while request 2 still ran
    assert eng.cache_status()["fork_snapshots_taken"] == 1  # 3..5 left the fork to request 2
    want = cold(ckpt, batch[1:])
    assert out[rids[0]][:GREEDY.max_tokens] == want[0]
    assert [out[r] for r in rids[1:]] == want[1:]
    assert_drained(eng)


def test_an_aborted_request_gives_its_fork_claim_to_the_next_one(ckpt):
    batch = prompts(1500, 4, seed=13)
    llm = make(ckpt, max_num_batched_tokens=CHUNK)
    eng = llm.engine
    llm.generate([batch[0]], GREEDY)
    eng.add_request(tokens(CHUNK, seed=99), GREEDY)  # takes the whole first prefill budget
    rid = eng.add_request(batch[1], GREEDY)
    eng.step()  # both admitted; request 2 planned its fork, but ran no chunk yet
    snaps = eng.scheduler.snaps
    assert snaps.forks[rid][0] == 1472 and len(snaps.claims) == 1
    assert eng.abort(rid)
    assert not snaps.claims and not snaps.forks
    while eng.has_unfinished():
        eng.step()
    hits, outs = one_after_another(llm, batch[2:])
    assert hits == [0, 1472]  # request 3 took the fork request 2 gave up
    assert outs == cold(ckpt, batch[2:])
    assert_drained(eng)


def test_a_fork_snapshot_goes_straight_to_the_host_bank_when_no_device_slot_can_be_had(ckpt):
    # 1 running request, no snapshot slots: 2 device slots (live + the track at 2176), and
    # request 2's admission moves request 1's 2176 to the bank (its 2048 went there at once),
    # so at 1472 nothing on the device is free or evictable
    batch = prompts(1500, 3, seed=17)
    llm = make(ckpt, max_running_reqs=1, num_snapshot_slots=0, host_snapshot_slots=8)
    eng = llm.engine
    hits, outs = [], []
    for prompt in batch:
        (o,) = llm.generate([prompt], GREEDY)
        hits.append(o.cached_tokens)
        outs.append(o.token_ids)
        if len(hits) == 2:
            (fork,) = [n for n in eng.prefix_cache.tree.nodes() if n.depth == 1472]
            assert fork.host_slot is not None and fork.snapshot_slot is None
    assert hits == [0, 0, 1472]  # request 3 restored from the bank
    assert outs == cold(ckpt, batch)
    assert eng.cache_status()["fork_snapshots_taken"] == 1
    assert_drained(eng)


@pytest.mark.gpu
def test_gpu_requests_sharing_1500_tokens_resume_at_the_fork_with_the_cold_tokens(ckpt):
    # CUDA: extension ops and fla-core's chunked prefill (TF32 dots), so a divergence from the
    # cold run is accepted only at a near tie of the reference (test_gpu_engine.GPU_EPS)
    batch = prompts(1500, 6, seed=15)
    llm = LLM(ckpt, device="cuda", dtype="float32", page_size=PAGE, chunk_size=CHUNK,
              num_pages=1024)
    hits, outs = one_after_another(llm, batch)
    assert hits == [0, 0] + [1472] * 4
    cold_llm = LLM(ckpt, device="cuda", dtype="float32", page_size=PAGE, chunk_size=CHUNK,
                   num_pages=1024, enable_prefix_cache=False)
    for i, (prompt, out) in enumerate(zip(batch, outs)):
        (c,) = cold_llm.generate([prompt], GREEDY)
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(out, c.token_ids, ref, f"gpu fork request {i + 1}", eps=0.05)
    assert llm.engine.cache_status()["fork_snapshots_taken"] == 1
    assert_drained(llm.engine)
