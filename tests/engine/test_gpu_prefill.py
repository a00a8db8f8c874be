"""The prefill path on CUDA (issue 27): fla-core's stages with host-built indices, the fused
conv + L2 norm, SDPA per request or padded, track snapshots written inside the forward. Greedy
tokens against transformers and against the cut-chunk path with the near-tie rule
(test_gpu_engine.py's GPU_EPS), snapshots close to the cut path's, and no host sync in a
prefill forward."""

from __future__ import annotations

import pytest
import torch

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint
from drained import assert_drained
from oracle import assert_same_greedy, assert_same_runs, reference_greedy
from token_ids import random_tokens as tokens

pytestmark = pytest.mark.gpu

GPU_EPS = 0.05
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """GDN head dim 32 (the GDN kernels' smallest): D = 256, the fused conv's whole warps."""
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("gpupre") / "m", "qwen3_5_text",
                                    seed=9, linear_key_head_dim=32, linear_value_head_dim=32))


def make(ckpt: str, in_forward: bool = True, **kw) -> LLM:
    kw.setdefault("chunk_size", 2048)
    llm = LLM(ckpt, device="cuda", dtype="float32", num_pages=512, page_size=16,
              cuda_graphs=False, **kw)
    llm.engine.scheduler.snaps.in_forward = in_forward
    return llm


@pytest.mark.parametrize("lengths", [(256,), (300, 64, 5), (3, 70, 128, 200, 256, 40)])
def test_prefill_batches_match_transformers(ckpt, lengths):
    # 1 and 3 requests attend one at a time, 6 take the padded path
    batch = [tokens(n, seed=n + 1) for n in lengths]
    outs = make(ckpt).generate(batch, GREEDY)
    for prompt, out in zip(batch, outs):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_greedy(out.token_ids, ref, f"gpu prefill len {len(prompt)}", eps=GPU_EPS)


def test_snapshots_written_inside_the_forward_match_the_cut_chunks(ckpt):
    prompts = [tokens(n, seed=n) for n in (256, 300, 129)]
    new, old = make(ckpt), make(ckpt, in_forward=False)
    outs_new = new.generate(prompts, GREEDY)
    outs_old = old.generate(prompts, GREEDY)
    for prompt, a, b in zip(prompts, outs_new, outs_old):
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(a.token_ids, b.token_ids, ref, f"in forward vs cut, {len(prompt)}",
                         eps=GPU_EPS)

    def snaps(llm):
        pool = llm.engine.state_pool
        return {n.depth: (pool.recurrent[:, n.snapshot_slot], pool.conv[:, n.snapshot_slot])
                for n in llm.engine.prefix_cache.tree.nodes() if n.snapshot_slot is not None}

    got, want = snaps(new), snaps(old)
    assert sorted(got) == sorted(want) and 192 in got and 256 in got
    # the same arithmetic over other chunk boundaries: fla's Triton dots take fp32 operands
    # as tf32 (10-bit mantissas), so states agree to tf32 rounding, not bits (1e-4 failed by
    # 1.8e-4 on 6 of 12,288 values on the H200, 2026-12-04)
    for d in got:
        for x, y in zip(got[d], want[d]):
            torch.testing.assert_close(x, y, atol=1e-3, rtol=1e-3)
    # resuming from the snapshots written inside the forward gives the cold tokens
    cold = make(ckpt, enable_prefix_cache=False)
    for prompt in ([*prompts[0][:250], *tokens(9, seed=3)], prompts[0]):
        (out,) = new.generate([prompt], GREEDY)
        assert out.cached_tokens == 192
        (c,) = cold.generate([prompt], GREEDY)
        ref = reference_greedy(ckpt, prompt, GREEDY.max_tokens)
        assert_same_runs(out.token_ids, c.token_ids, ref, "resumed vs cold", eps=GPU_EPS)
    assert_drained(new.engine)


@pytest.mark.parametrize("lengths", [(256,), (300, 64, 5), (3, 70, 128, 200, 256, 40)])
def test_a_prefill_forward_never_waits_for_the_device(ckpt, lengths):
    llm = make(ckpt)
    eng = llm.engine
    batch_ids = [tokens(n, seed=n + 11) for n in lengths]
    llm.generate(batch_ids, SamplingParams(temperature=0.0, max_tokens=1))  # compile first
    eng.flush_cache()
    for ids in batch_ids:
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    batch = eng.scheduler.schedule()
    assert batch.num_tokens == sum(lengths) and batch.tracks is not None
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.runner.forward(batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    for req in batch.reqs:
        eng.abort(req.rid)
