"""The MoE decode kernels (csrc/kernels/moe_route.cuh, moe_experts.cuh) on the GPU through
ops.moe_fused.moe_fused, against `moe_fused_reference` within the rounding contract
(moe_inputs.py): Qwen3.6-35B-A3B shapes (256 experts top-8, H 2048, I 512, shared 512) at 1, 8,
32, 64, 128 (32 verify steps of 4 rows) and 256 tokens in bf16, fp16, odd sizes; routing and
grouping exactly (ties included); the same bits on every run, alone or in a batch, eager or
replayed from a CUDA graph; no host sync. Inputs are fresh each run (the seed is printed: replay
a failure with MOE_SEED=<seed>)."""

from __future__ import annotations

import os

import pytest
import torch
from moe_inputs import assert_close_to_reference

from deltaserve.ops import moe_fused as mf
from deltaserve.ops._ext import extension_loaded

pytestmark = pytest.mark.gpu
E, K, H, I = 256, 8, 2048, 512
SEED = int(os.environ.get("MOE_SEED", int.from_bytes(os.urandom(4), "little")))


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


def _draw(gen, *shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda", generator=gen) * scale).to(dtype)


@pytest.fixture(scope="module")
def weights():
    """35B-A3B's experts and shared expert, bf16, drawn on the GPU (1.6 GB)."""
    print(f"MOE_SEED={SEED}")
    gen = torch.Generator(device="cuda").manual_seed(SEED)
    return (_draw(gen, E, 2 * I, H, scale=H ** -0.5), _draw(gen, E, H, I, scale=I ** -0.5),
            _draw(gen, 2 * I, H, scale=H ** -0.5), _draw(gen, H, I, scale=I ** -0.5))


def _tokens(t, salt, dtype=torch.bfloat16, e=E, h=H, shared=True):
    gen = torch.Generator(device="cuda").manual_seed(SEED + salt)
    return _draw(gen, t, h, dtype=dtype), _draw(gen, t, e + shared, dtype=dtype)


def _check(x, logits, w, k=K, norm=True):
    assert mf.fused_fits(x, logits, *w[:2], k, *(*w[2:], None, None)[:2])
    got = mf.moe_fused(x, logits, *w[:2], k, norm, *w[2:])
    assert_close_to_reference(got, mf.moe_fused_reference(x, logits, *w[:2], k, norm, *w[2:]))
    return got


@pytest.mark.parametrize("t", [1, 8, 32, 64, 128, 256])
def test_fused_moe_matches_the_reference_at_35b_shapes(weights, t):
    _check(*_tokens(t, salt=t), weights)


@pytest.mark.parametrize("t", [1, 32])
def test_fused_moe_matches_the_reference_in_fp16(weights, t):
    _check(*_tokens(t, salt=100 + t, dtype=torch.float16), [w.half() for w in weights])


@pytest.mark.parametrize("shared", [True, False])
def test_fused_moe_matches_the_reference_at_odd_sizes(shared):
    # E 60, top-6, no renormalisation; H 2056 (down's last column group partial), I 264, Is 136
    gen = torch.Generator(device="cuda").manual_seed(SEED + 7)
    h, i, si = 2056, 264, 136
    w = [_draw(gen, 60, 2 * i, h, scale=h ** -0.5), _draw(gen, 60, h, i, scale=i ** -0.5)]
    if shared:
        w += [_draw(gen, 2 * si, h, scale=h ** -0.5), _draw(gen, h, si, scale=si ** -0.5)]
    _check(*_tokens(37, salt=37, e=60, h=h, shared=shared), w, k=6, norm=False)


def test_fused_routing_ranks_ties_and_groups_pairs_as_the_reference():
    _, logits = _tokens(256, salt=3)
    logits[:, 10:14] = logits[:, 10:11]  # 4-way ties, at the top-k boundary for some tokens
    weight, expert, pair_row, row_token, tiles, n_tiles, scale, _ = torch.ops.deltaserve.moe_route(
        logits, E, K, True, True, H)
    want_w, want_i = mf.route_fused_reference(logits, E, K, True)
    assert torch.equal(expert.long(), want_i)
    torch.testing.assert_close(weight, want_w, atol=1e-6, rtol=1e-6)
    want_pr, want_rt, want_tiles, n_shared = mf.grouping_reference(want_i.cpu(), E, True)
    assert torch.equal(pair_row.long().cpu(), want_pr)
    assert torch.equal(row_token.long().cpu(), want_rt)
    assert n_tiles.tolist() == [n_shared, want_tiles.shape[0]]
    assert torch.equal(tiles[: want_tiles.shape[0]].long().cpu(), want_tiles)
    torch.testing.assert_close(scale, torch.sigmoid(logits[:, E].float()))


def test_fused_moe_gives_the_same_bits_every_run_and_alone_or_in_a_batch(weights):
    x, logits = _tokens(64, salt=5)
    batch = mf.moe_fused(x, logits, *weights[:2], K, True, *weights[2:])
    for _ in range(3):  # blocks arrive at the combine in other orders
        assert torch.equal(mf.moe_fused(x, logits, *weights[:2], K, True, *weights[2:]), batch)
    for i in (0, 17, 63):
        alone = mf.moe_fused(x[i:i + 1], logits[i:i + 1], *weights[:2], K, True, *weights[2:])
        assert torch.equal(alone, batch[i:i + 1])


def test_fused_moe_replayed_from_a_cuda_graph_gives_the_eager_bits(weights):
    x, logits = _tokens(32, salt=6)
    run = lambda: mf.moe_fused(x, logits, *weights[:2], K, True, *weights[2:])  # noqa: E731
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = run()
    for salt in (8, 9):
        nx, nl = _tokens(32, salt=salt)
        x.copy_(nx)
        logits.copy_(nl)
        graph.replay()
        assert torch.equal(y, run())


@pytest.mark.parametrize("t", [1, 256])
def test_fused_moe_never_syncs_with_the_host(weights, t):
    x, logits = _tokens(t, salt=11)
    mf.moe_fused(x, logits, *weights[:2], K, True, *weights[2:])
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mf.moe_fused(x, logits, *weights[:2], K, True, *weights[2:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
