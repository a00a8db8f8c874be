"""The engine's decode and verify steps on the paged attention kernels (bf16, head dim 128,
GQA 4): CUDA graphs at contexts past the old 8,192-position graph limit run with no eager
step, and give the tokens of the eager kernel path and of the pure-torch reference path
(near-tie rule against transformers)."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.ops import attention as attention_ops
from oracle import assert_same_runs, reference_greedy
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

BF16_EPS = 0.25  # bf16 weights and activations against the fp32 reference
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("pattn") / "m", "qwen3_5_text",
                                    seed=5, num_attention_heads=8, num_key_value_heads=2,
                                    head_dim=128, max_position_embeddings=16384))


def make(ckpt: str, **kw) -> LLM:
    return LLM(ckpt, device="cuda", dtype="bfloat16", num_pages=2048, page_size=16,
               max_running_reqs=4, **kw)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_graphs_at_long_contexts_give_the_eager_and_reference_tokens(ckpt, spec, monkeypatch):
    kw = (dict(speculative_algorithm=spec, speculative_num_steps=3, speculative_policy="fixed")
          if spec else {})
    batch = [tokens(n, seed=n) for n in (5, 700, 9000)]
    graphs = make(ckpt, **kw)
    got = [o.token_ids for o in graphs.generate(batch, GREEDY)]
    runner = graphs.engine.graphs
    assert runner.graph_steps > 0 and runner.eager_steps == 0, "a step ran without a graph"
    eager = [o.token_ids for o in make(ckpt, cuda_graphs=False, **kw).generate(batch, GREEDY)]
    monkeypatch.setattr(attention_ops, "_kernel_ok", lambda *ts: False)
    ref_path = [o.token_ids for o in make(ckpt, **kw).generate(batch, GREEDY)]
    for prompt, a, b, c in zip(batch, got, eager, ref_path):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(a, b, ref, f"graphs vs eager, len {len(prompt)}", eps=BF16_EPS)
        assert_same_runs(a, c, ref, f"kernel vs reference, len {len(prompt)}", eps=BF16_EPS)
