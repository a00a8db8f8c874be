"""The fixed-shape step that CUDA graphs capture (padded batch, padded KV length, padding slot
and page) gives the eager step's tokens. Run eagerly here (capture=False); the gpu test in
test_gpu_engine.py replays real graphs."""

from __future__ import annotations

import random

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner, buckets
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("graph") / "m", "qwen3_5_text",
                                    seed=9))


def prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(500) for _ in range(n)] for n in (2, 33, 90)]


def with_static_steps(llm: LLM) -> GraphRunner:
    eng = llm.engine
    eng.graphs = GraphRunner(eng.runner, eng.cfg.max_running_reqs, eng.cfg.decode_rows_per_req,
                             eng.max_model_len, capture=False)
    return eng.graphs


def test_buckets_cover_the_limit_with_powers_of_two():
    assert buckets(5, 1) == [1, 2, 4, 8]
    assert buckets(256, 256) == [256]


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_padded_fixed_shape_steps_give_the_eager_tokens(ckpt, spec):
    kw = dict(device="cpu", dtype="float32", num_pages=512, page_size=16, max_running_reqs=6)
    if spec:
        kw.update(speculative_algorithm=spec, speculative_num_steps=3, speculative_policy="fixed")
    eager = LLM(ckpt, **kw)
    static = LLM(ckpt, **kw)
    runner = with_static_steps(static)
    want = [o.token_ids for o in eager.generate(prompts(), GREEDY)]
    got = [o.token_ids for o in static.generate(prompts(), GREEDY)]
    assert got == want
    assert runner.graphs, "the fixed-shape path was never taken"
    # a batch of 3 ran in the bucket of 4: one padding request on slot 0 / page 0
    assert any(key[0] == 4 for key in runner.graphs)
    for g in runner.graphs.values():  # the step's own argmax is what greedy rows commit
        assert torch.equal(g.greedy, g.logits.argmax(dim=-1))
    if spec:  # verify steps of the same batch took the previous step's rows (replay folded in)
        pool = static.engine.state_pool
        assert pool.n_taken > 0 and not pool.has_pending
    assert_drained(static.engine)


@pytest.mark.parametrize("spec", [None, "mtp"])
def test_graphs_captured_at_start_cover_every_bucket_and_keep_the_tokens(ckpt, spec, tmp_path):
    """capture_all builds every bucket's step up front (both stash parities for verify, and
    the MTP proposer's steps): a later batch finds its graph, and the tokens do not change."""
    kw = dict(device="cpu", dtype="float32", num_pages=512, page_size=16, max_running_reqs=6)
    path = ckpt
    if spec:
        path = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=9, with_mtp=True))
        kw.update(speculative_algorithm=spec, speculative_num_steps=3, speculative_policy="fixed")
    eager = LLM(path, **kw)
    static = LLM(path, **kw)
    runner = with_static_steps(static)
    want_keys = ({(b, w) for b in (1, 2, 4, 6) for w in (0, 1)} if spec
                 else {(b,) for b in (1, 2, 4, 6)})
    assert runner.capture_all() == len(want_keys)
    assert set(runner.graphs) == want_keys
    assert runner.capture_all() == 0  # nothing left to capture
    if spec:
        static.engine.spec.use_graphs(6, static.engine.max_model_len, capture=False)
        mtp = static.engine.spec.proposer.graphs
        assert mtp.capture_all() == 4 and set(mtp.graphs) == {1, 2, 4, 6}
    want = [o.token_ids for o in eager.generate(prompts(), GREEDY)]
    got = [o.token_ids for o in static.generate(prompts(), GREEDY)]
    assert got == want
    assert set(runner.graphs) == want_keys and runner.graph_steps > 0
    assert_drained(static.engine)
