"""Overlap scheduling on a CUDA device with captured graphs: the same equalities as on CPU
(test_overlap.py), now with the next step really launched while the previous one runs.

Token-for-token equality is the contract where both engines run every step in the same graph
bucket (a row's result then does not depend on the other rows); a request stopped by a token
stays in the overlapped engine's next step as a discarded row, so the workloads keep at least
5 requests running (bucket 8) until the stop. Arrivals and aborts change buckets at different
calls in the two engines: there greedy runs are compared with the near-tie rule."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch

from deltaserve import SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy
from overlap_driver import abort, add, drive, first_new, make_engine, snapshots, stop_on_grid
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05  # as test_gpu_engine.py


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpu_overlap") / "m",
                                    "qwen3_5_text", seed=4))


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, **kw)


def sampled(n: int, seed: int, **kw) -> SamplingParams:
    kw.setdefault("temperature", 0.9)
    return SamplingParams(max_tokens=n, seed=seed, ignore_eos=True, **kw)


def test_gpu_overlap_gives_the_synchronous_tokens_greedy_and_seeded(ckpt):
    prompts = [tokens(n, seed=n) for n in (5, 40, 70, 17, 90, 33, 51)]
    params = [greedy(16), greedy(24), greedy(20), sampled(16, seed=7, top_p=0.9),
              sampled(20, seed=11, top_k=5, min_p=0.05),
              sampled(24, seed=5, temperature=1.3), greedy(18)]

    def script(ps: list[SamplingParams]) -> dict:
        return {0: [add(i, p, q) for i, (p, q) in enumerate(zip(prompts, ps))]}

    # stop tokens for requests 1 and 5 from a run of the same batch (same graph buckets)
    base = drive(make_engine(ckpt, False, "cuda"), script(params))
    for rid, j in ((1, 3), (5, 5)):
        out = base[rid].tokens
        params[rid] = replace(params[rid], stop_token_ids=[out[first_new(out, j)]])
    off, on = make_engine(ckpt, False, "cuda"), make_engine(ckpt, True, "cuda")
    want, got = drive(off, script(params)), drive(on, script(params))
    # the premise: both stops come while at least 5 others run (bucket 8 in both engines)
    assert want[1].reason == want[5].reason == "stop"
    assert len(want[1].tokens) < 16 and len(want[5].tokens) < 16
    for rid in want:
        assert (got[rid].tokens, got[rid].reason) == (want[rid].tokens, want[rid].reason), rid
    assert on.overlap.overlapped_steps > 5 and on.overlap.discarded_rows == 2
    assert on.graphs.graph_steps > 0 and on.graphs.eager_steps == 0
    assert_drained(on)


def test_gpu_overlap_with_arrivals_and_an_abort_mid_decode(ckpt):
    prompts = [tokens(n, seed=n + 50) for n in (9, 60, 130, 21, 75)]
    params = [greedy(14), greedy(10), greedy(18), greedy(30), greedy(12)]
    script = {0: [add(i, prompts[i], params[i]) for i in range(3)],
              3: [add(3, prompts[3], params[3]), add(4, prompts[4], params[4])],
              9: [abort(3)]}
    off, on = make_engine(ckpt, False, "cuda"), make_engine(ckpt, True, "cuda")
    want, got = drive(off, script), drive(on, script)
    for rid in range(5):
        ref = reference_greedy(ckpt, prompts[rid], params[rid].max_tokens)
        a, b = got[rid].tokens, want[rid].tokens
        if rid == 3:  # aborted at the same call; the engines got to different lengths
            assert 0 < len(a) < 30 and 0 < len(b) < 30
            a, b = a[:min(len(a), len(b))], b[:min(len(a), len(b))]
        assert_same_runs(a, b, ref, f"overlap on/off, request {rid}", eps=GPU_EPS)
    assert on.overlap.overlapped_steps > 5
    assert_drained(on)
    assert_drained(off)


@pytest.mark.parametrize("finish", ["stop", "length"])
def test_gpu_a_finish_on_the_grid_caches_no_stale_snapshot(ckpt, finish):
    # as test_overlap.py's CPU test: 181 + 12 - 1 = 192 tokens processed at the finish
    prompt = tokens(181, seed=21)
    sync = partial(make_engine, ckpt, False, "cuda")
    params = sampled(12, seed=9) if finish == "length" \
        else stop_on_grid(sync, prompt, 12, range(9, 40))
    off, on = sync(), make_engine(ckpt, True, "cuda")
    want = drive(off, {0: [add(0, prompt, params)]})[0]
    got = drive(on, {0: [add(0, prompt, params)]})[0]
    assert got.tokens == want.tokens and (got.reason, len(got.tokens)) == (finish, 12)
    ref, mine = snapshots(off), snapshots(on)
    assert (192 in mine) == (finish == "length") and 192 in ref
    for depth, (rec, conv) in mine.items():
        assert torch.equal(rec, ref[depth][0]) and torch.equal(conv, ref[depth][1]), depth
    assert_drained(on)
