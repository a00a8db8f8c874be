"""Tensor parallel on 2 GPUs (NCCL, bf16): TP 2 gives TP 1's greedy tokens up to a near tie of
the fp32 reference (the near-tie rule, oracle.py), with the prefix cache and speculation, and
frees every rank's pools. Needs 2 visible GPUs (nvidia-h200-x2); never run here yet."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import assert_same_runs, reference_greedy
from token_ids import random_tokens

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

BF16_EPS = 0.1  # bf16 rounds each GEMM's output; the row-parallel sums reduce in another order
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def run(path: str, tp: int, prompts: list[list[int]], **kw) -> list[list[int]]:
    llm = LLM(path, device="cuda", dtype="bfloat16", num_pages=512, page_size=16,
              tensor_parallel_size=tp, **kw)
    try:
        first = llm.generate(prompts, GREEDY)
        second = llm.generate([p + o.token_ids + [5, 6] for p, o in zip(prompts, first)], GREEDY)
        assert_drained(llm.engine)
        return [o.token_ids for o in first + second], [p + o.token_ids + [5, 6]
                                                       for p, o in zip(prompts, first)]
    finally:
        if tp > 1:
            llm.engine.close()


@pytest.mark.parametrize("kind", ["qwen3_5_text", "qwen3_5_moe_text", "qwen3_next"])
@pytest.mark.parametrize("spec", [{}, {"speculative_algorithm": "ngram"},
                                  {"speculative_algorithm": "mtp"}])
def test_bf16_greedy_at_tp_2_equals_tp_1_up_to_a_near_tie(tmp_path, kind, spec):
    path = str(make_tiny_checkpoint(tmp_path / kind, kind, seed=5))
    prompts = [random_tokens(n, seed=n) for n in (7, 70, 150)]
    spec = {**spec, "speculative_policy": "fixed"} if spec else spec
    ref_tokens, second_prompts = run(path, 1, prompts, **spec)
    tokens, _ = run(path, 2, prompts, **spec)
    for i, prompt in enumerate(prompts + second_prompts):
        ref = reference_greedy(path, prompt, GREEDY.max_tokens)
        assert_same_runs(tokens[i], ref_tokens[i], ref, f"{kind} {spec} prompt {i}",
                         eps=BF16_EPS)
