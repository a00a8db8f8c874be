"""Track snapshots written inside a forward: a prompt's chunk runs past its last grid boundary B
(and B - G for a 64n-token prompt) instead of ending there, and the forward writes the GDN state
at that depth into the track slot. One forward fewer, the same snapshots and the same tokens.

CPU, fp32, a slow-decay checkpoint (a stale or misplaced state changes the tokens).
"""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from drained import assert_drained
from slow_decay import slow_decay_checkpoint
from token_ids import random_tokens as tokens

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return slow_decay_checkpoint(tmp_path_factory.mktemp("track") / "m", seed=6)


def make(ckpt: str, in_forward: bool = True, **kw) -> LLM:
    kw.setdefault("chunk_size", 2048)
    llm = LLM(ckpt, device="cpu", dtype="float32", num_pages=512, page_size=16, **kw)
    llm.engine.scheduler.snaps.in_forward = in_forward
    return llm


def snapshots(llm: LLM) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    pool = llm.engine.state_pool
    return {n.depth: (pool.recurrent[:, n.snapshot_slot].clone(),
                      pool.conv[:, n.snapshot_slot].clone())
            for n in llm.engine.prefix_cache.tree.nodes() if n.snapshot_slot is not None}


@pytest.mark.parametrize(("length", "depths"), [(256, [192, 256]), (300, [256]), (70, [64])])
def test_one_forward_leaves_the_snapshots_the_cut_chunks_left(ckpt, length, depths):
    prompt = tokens(length, seed=length)
    new, old = make(ckpt), make(ckpt, in_forward=False)
    (a,) = new.generate([prompt], ONE)
    (b,) = old.generate([prompt], ONE)
    assert new.engine.num_steps == 1 and old.engine.num_steps == 2
    assert a.token_ids == b.token_ids
    got, want = snapshots(new), snapshots(old)
    assert sorted(got) == sorted(want) == depths
    for d in depths:  # the state after exactly prompt[:d], from the same arithmetic
        for x, y in zip(got[d], want[d]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert_drained(new.engine)


def test_resumes_from_a_snapshot_written_inside_a_forward_give_the_cold_tokens(ckpt):
    base = tokens(256, seed=1)
    llm, cold = make(ckpt), make(ckpt, enable_prefix_cache=False)
    (a,) = llm.generate([base], GREEDY)
    (again,) = llm.generate([base], GREEDY)  # recomputes its last token: resumes at 192
    assert again.cached_tokens == 192 and again.token_ids == a.token_ids
    assert a.token_ids == cold.generate([base], GREEDY)[0].token_ids
    for cut in (193, 257, 280):
        prompt = (base + tokens(30, seed=2))[:cut]
        (out,) = llm.generate([prompt], GREEDY)
        assert out.cached_tokens == (192 if cut < 257 else 256), cut
        assert out.token_ids == cold.generate([prompt], GREEDY)[0].token_ids, cut
    assert_drained(llm.engine)


def test_a_batch_of_prompts_each_split_at_its_boundary_matches_the_cut_chunks(ckpt):
    prompts = [tokens(n, seed=n) for n in (128, 75, 200, 5, 320)]
    new, old = make(ckpt), make(ckpt, in_forward=False)
    outs_new = new.generate(prompts, GREEDY)
    outs_old = old.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs_new] == [o.token_ids for o in outs_old]
    got, want = snapshots(new), snapshots(old)
    assert sorted(got) == sorted(want)
    for d in got:
        for x, y in zip(got[d], want[d]):
            torch.testing.assert_close(x, y, atol=1e-6, rtol=1e-5)
    assert_drained(new.engine)


def test_chunk_len_runs_past_one_track_depth_and_names_it(ckpt):
    llm = make(ckpt, chunk_size=64)
    eng = llm.engine
    eng.add_request(tokens(256, seed=3), ONE)
    batch = eng.scheduler.schedule()  # chunk 64 cuts on its own: no track inside
    assert batch.extend_lens == [64] and batch.tracks is None
    snaps, req = eng.scheduler.snaps, batch.reqs[0]
    assert sorted(snaps.tracks[req.rid]) == [192, 256]
    assert snaps.chunk_len(req, 256) == 256  # 192 inside, 256 its end
    assert snaps.interior_track(req, 256) == (192, snaps.tracks[req.rid][192])
    assert snaps.interior_track(req, 192) is None  # ends there: copied after the chunk
    snaps.in_forward = False
    assert snaps.chunk_len(req, 256) == 192
    snaps.tracks[req.rid][100] = snaps.tracks[req.rid].pop(192)  # two inside: cut at the 2nd
    snaps.tracks[req.rid][200] = 0
    snaps.in_forward = True
    assert snaps.chunk_len(req, 256) == 200
