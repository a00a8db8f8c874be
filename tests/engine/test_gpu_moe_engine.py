"""A MoE model on the GPU with CUDA graphs: fp32 (the gathered experts) matches transformers,
bf16 (the grouped GEMMs) stays close to it, and MTP speculation gives the tokens of plain decode.
The near-tie rule and epsilon are those of test_gpu_engine.py."""

from __future__ import annotations

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import Reference, assert_same_greedy, assert_same_runs, reference_greedy, router_margin
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module", params=["qwen3_5_moe_text", "qwen3_next"])
def ckpt(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("gpu_moe") / request.param
    return str(make_tiny_checkpoint(path, request.param, seed=4))


def make(ckpt: str, dtype: str = "float32", **kw) -> LLM:
    return LLM(ckpt, device="cuda", dtype=dtype, num_pages=1024, page_size=16,
               max_running_reqs=8, **kw)


def test_gpu_moe_decodes_in_cuda_graphs_and_matches_transformers(ckpt):
    batch = [tokens(n, seed=n) for n in (3, 70, 200)]
    llm = make(ckpt)
    assert llm.engine.graphs is not None
    outs = llm.generate(batch, GREEDY)
    assert llm.engine.graphs.graph_steps > 0  # decode steps were replayed from captured graphs
    for prompt, out in zip(batch, outs):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, ref, f"gpu moe len {len(prompt)}", eps=GPU_EPS)
    assert_drained(llm.engine)


def test_gpu_moe_mtp_speculation_gives_the_tokens_of_plain_decode(ckpt):
    batch = [tokens(n, seed=n + 1) for n in (5, 60, 130)]
    plain = make(ckpt)
    spec = make(ckpt, speculative_algorithm="mtp", speculative_num_steps=3,
                speculative_policy="fixed")
    assert spec.engine.graphs is not None
    off = [o.token_ids for o in plain.generate(batch, GREEDY)]
    on = [o.token_ids for o in spec.generate(batch, GREEDY)]
    assert spec.engine.graphs.graph_steps > 0
    for prompt, a, b in zip(batch, off, on):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(b, a, ref, f"mtp vs plain len {len(prompt)}", eps=GPU_EPS)


def clear_prompt(ckpt: str, n: int) -> tuple[list[int], Reference]:
    """The first seeded n-token prompt whose first generated token bf16 cannot legitimately
    change: the fp32 reference's top-2 logit gap >= 0.25 and no router near-tie (margin >= 0.1,
    `router_margin`) at the last prompt token. Seed 7 had a 0.021 router margin in layer 1,
    and the bf16 GPU run took the other expert there (12-04)."""
    for seed in range(7, 47):
        prompt = tokens(n, seed=seed)
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        if ref.gaps[0] >= 0.25 and router_margin(ckpt, prompt) >= 0.1:
            return prompt, ref
    raise AssertionError("no clear prompt in 40 seeds")


def test_gpu_moe_in_bfloat16_runs_grouped_gemms_in_graphs_close_to_the_reference(ckpt):
    # 300 prompt tokens: the prefill takes the grouped GEMMs (the fused kernels take <= 256)
    prompt, ref = clear_prompt(ckpt, 300)
    llm = make(ckpt, dtype="bfloat16")
    assert llm.engine.graphs is not None
    (out,) = llm.generate([prompt], GREEDY)
    (eager,) = make(ckpt, dtype="bfloat16", cuda_graphs=False).generate([prompt], GREEDY)
    assert llm.engine.graphs.graph_steps > 0
    # bf16 weights: the first token must agree (the prompt has no tie bf16 may break)
    assert out.token_ids[0] == ref.tokens[0]
    assert_same_runs(out.token_ids, eager.token_ids, ref, "bf16 graphs vs eager", eps=0.25)
