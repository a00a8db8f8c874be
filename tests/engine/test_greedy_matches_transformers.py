"""deltaserve's greedy tokens equal transformers' on tiny random checkpoints (fp32, CPU)."""

from __future__ import annotations

import random

import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from oracle import assert_same_greedy, reference_greedy

MAX_NEW = 10
PROMPT_LENS = (1, 7, 70, 150)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {kind: str(make_tiny_checkpoint(root / kind, kind, seed=1))
            for kind in ("qwen3_5_text", "qwen3_next", "qwen3_5_moe_text")}


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in PROMPT_LENS]


def run(path: str, batch: list[list[int]], **cfg) -> list[list[int]]:
    llm = LLM(path, device="cpu", dtype="float32", num_pages=512, **cfg)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate(batch, params)
    llm.engine.prefix_cache.check_integrity()
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("chunk_size,page_size", [
    (16, 1), (16, 16), (16, 64), (64, 1), (64, 16), (64, 64), (1000, 1), (1000, 16), (1000, 64)])
def test_a_mixed_batch_of_dense_qwen3_5_matches_transformers(checkpoints, chunk_size, page_size):
    path = checkpoints["qwen3_5_text"]
    batch = prompts(512)
    outs = run(path, batch, chunk_size=chunk_size, page_size=page_size)
    for prompt, ours in zip(batch, outs):
        ref = reference_greedy(path, prompt, MAX_NEW)
        assert_same_greedy(ours, ref, f"len {len(prompt)} chunk {chunk_size} page {page_size}")


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_text"])
@pytest.mark.parametrize("chunk_size,page_size", [(16, 16), (1000, 1)])
def test_qwen3_next_and_moe_match_transformers(checkpoints, kind, chunk_size, page_size):
    path = checkpoints[kind]
    batch = prompts(512, seed=3)
    outs = run(path, batch, chunk_size=chunk_size, page_size=page_size)
    for prompt, ours in zip(batch, outs):
        ref = reference_greedy(path, prompt, MAX_NEW)
        assert_same_greedy(ours, ref, f"{kind} len {len(prompt)} chunk {chunk_size}")


def test_a_single_request_matches_transformers(checkpoints):
    path = checkpoints["qwen3_5_text"]
    prompt = prompts(512, seed=9)[2]
    (ours,) = run(path, [prompt], chunk_size=64, page_size=16)
    assert_same_greedy(ours, reference_greedy(path, prompt, MAX_NEW), "single request")
