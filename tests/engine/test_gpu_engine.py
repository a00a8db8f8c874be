"""The engine on a CUDA device (extension ops, fla-core prefill): the same equalities as on CPU.

GPU kernels reduce in another order than the CPU reference (fla-core's chunked prefill uses TF32
dots), so the near-tie epsilon is stated wider here: a divergence is accepted only where the
reference's top-2 logit gap is below GPU_EPS, and it is reported as a NearTieWarning.
"""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import assert_same_greedy, assert_same_runs, reference_greedy
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpu") / "m", "qwen3_5_text", seed=4))


def make(ckpt: str, **kw) -> LLM:
    kw.setdefault("page_size", 16)
    return LLM(ckpt, device="cuda", dtype="float32", num_pages=1024, **kw)


@pytest.mark.parametrize("chunk_size", [64, 1000])
def test_gpu_greedy_matches_transformers(ckpt, chunk_size):
    batch = [tokens(n, seed=n) for n in (3, 70, 200)]
    outs = make(ckpt, chunk_size=chunk_size).generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, ref, f"gpu len {len(prompt)}", eps=GPU_EPS)


def test_gpu_prefix_cache_on_and_off_give_the_same_tokens(ckpt):
    turn1 = tokens(150, seed=1)
    llm, cold = make(ckpt), make(ckpt, enable_prefix_cache=False)
    (a1,) = llm.generate([turn1], GREEDY)
    turn2 = turn1 + a1.token_ids + tokens(40, seed=2)
    (a2,) = llm.generate([turn2], GREEDY)
    (c2,) = cold.generate([turn2], GREEDY)
    assert a2.cached_tokens == 128
    ref = reference_greedy(ckpt, turn2, GREEDY.max_tokens)
    assert_same_runs(a2.token_ids, c2.token_ids, ref, "gpu cache on/off", eps=GPU_EPS)
    assert_drained(llm.engine)


def test_gpu_bfloat16_serving_stays_close_to_the_reference(ckpt):
    prompt = tokens(100, seed=7)
    llm = LLM(ckpt, device="cuda", dtype="bfloat16", num_pages=256, page_size=16)
    (out,) = llm.generate([prompt], GREEDY)
    ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
    # bf16 weights: the first token must agree unless the reference is within bf16 noise
    assert out.token_ids[0] == ref.tokens[0] or ref.gaps[0] < 0.25


@pytest.mark.parametrize("algo", ["ngram", "mtp"])
def test_gpu_speculation_on_and_off_give_the_same_tokens_with_cuda_graphs(ckpt, algo):
    batch = [tokens(n, seed=n + 1) for n in (5, 60, 130)]
    graphs = make(ckpt, max_running_reqs=8)
    eager = make(ckpt, max_running_reqs=8, cuda_graphs=False)
    spec = make(ckpt, max_running_reqs=8, speculative_algorithm=algo, speculative_num_steps=3,
                speculative_policy="fixed")
    assert graphs.engine.graphs is not None and spec.engine.graphs is not None
    off = [o.token_ids for o in graphs.generate(batch, GREEDY)]
    ref_eager = [o.token_ids for o in eager.generate(batch, GREEDY)]
    on = [o.token_ids for o in spec.generate(batch, GREEDY)]
    # graphs were replayed
    assert graphs.engine.graphs.graph_steps > 0 and spec.engine.graphs.graph_steps > 0
    for prompt, a, b, c in zip(batch, off, ref_eager, on):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(a, b, ref, f"graphs vs eager len {len(prompt)}", eps=GPU_EPS)
        assert_same_runs(c, a, ref, f"{algo} vs plain len {len(prompt)}", eps=GPU_EPS)


@pytest.fixture(scope="module")
def ckpt_k32(tmp_path_factory):
    """GDN head dims the CUDA kernels take (the tiny default, 16, runs the torch reference)."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpu32") / "m", "qwen3_5_text",
                                    seed=5, linear_key_head_dim=32, linear_value_head_dim=32))


def test_gpu_kernels_fold_the_accepted_rows_into_the_next_verify_and_keep_the_tokens(ckpt_k32):
    batch = [tokens(n, seed=n + 7) for n in (9, 70)]
    plain = make(ckpt_k32, max_running_reqs=4)
    spec = make(ckpt_k32, max_running_reqs=4, speculative_algorithm="ngram",
                speculative_num_steps=3, speculative_policy="fixed")
    off = [o.token_ids for o in plain.generate(batch, GREEDY)]
    on = [o.token_ids for o in spec.generate(batch, GREEDY)]
    pool = spec.engine.state_pool
    assert pool.n_taken > 0, "no verify took the previous step's rows (gdn_replay_verify)"
    assert not pool.has_pending
    for prompt, a, b in zip(batch, off, on):
        ref = reference_greedy(ckpt_k32, prompt, GREEDY.max_tokens)
        assert_same_runs(b, a, ref, f"ngram vs plain len {len(prompt)}", eps=GPU_EPS)
    assert_drained(spec.engine)
