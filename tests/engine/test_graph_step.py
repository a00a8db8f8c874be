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
