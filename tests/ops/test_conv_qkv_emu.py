"""gdn_conv_prefill's kernel code (emulated on the CPU, tests/ops/kernels_emu.py): the q | k | v
blocks with q and k L2-normalised against conv_qkv_prefill's reference, windows (final and
tracked) as causal_conv1d_prefill writes them, every prefill tile size, and the plain prefill's
output unchanged by the shorter tiles."""

from __future__ import annotations

import kernels_emu
import pytest
import torch

from deltaserve.ops.conv1d import (
    causal_conv1d_prefill,
    conv1d_prefill_ref,
    conv_qkv_prefill,
)
from deltaserve.ops.gdn import _l2norm

W = 4
H, K, HV, V = 2, 32, 4, 32  # D = 256: 32 threads of 8 bf16 (4 fp32) channels a token


def setup(d: int, n: int, lengths: list[int], dtype, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(d, W, generator=gen) * 0.5).to(dtype)
    bias = (torch.randn(d, generator=gen) * 0.1).to(dtype)
    state = torch.randn(2 * n + 2, W - 1, d, generator=gen).to(dtype)
    x = torch.randn(sum(lengths), d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = torch.randperm(n, generator=gen).int() + 1
    offsets = torch.tensor([ln // 2 for ln in lengths], dtype=torch.int32)
    track = torch.arange(n + 1, 2 * n + 1, dtype=torch.int32)
    track[::2] = 0
    return weight, bias, state, x, cu, slots, offsets, track


@pytest.mark.parametrize("lengths", [[300], [1, 70, 0, 5], [64] * 5, [2000]])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_emulated_qkv_prefill_matches_the_reference(monkeypatch, lengths, dtype):
    d = 2 * H * K + HV * V
    weight, bias, state, x, cu, slots, offsets, track = setup(d, len(lengths), lengths, dtype,
                                                              seed=len(lengths))
    ref_state, plain_state = state.clone(), state.clone()
    y_ref = conv1d_prefill_ref(x, weight, bias, ref_state, cu, slots, offsets, track)
    ops = kernels_emu.emulate(monkeypatch)
    y = causal_conv1d_prefill(x, weight, bias, plain_state, cu, slots, offsets, track)
    q, k, v = conv_qkv_prefill(x, weight, bias, state, cu, slots, offsets, track,
                               num_k_heads=H, head_k_dim=K)
    assert ops.calls == 2  # one kernel call each: the fused form, not the conv plus a norm
    assert torch.equal(state, ref_state) and torch.equal(state, plain_state)
    t = x.shape[0]
    assert q.is_contiguous() and k.is_contiguous() and v.is_contiguous()
    assert q.shape == k.shape == (t, H, K) and v.shape == (t, HV * V) and q.dtype == dtype
    # the plain kernel's conv output bit for bit (the same fma chain and silu), which is the
    # reference's within the conv kernels' tolerance; the norm up to its fp32 sum order
    assert torch.equal(v, y[:, 2 * H * K:])
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    tol = dict(atol=1e-6, rtol=1e-6) if dtype == torch.float32 else dict(atol=8e-3, rtol=8e-3)
    for got, part in ((q, y[:, :H * K]), (k, y[:, H * K:2 * H * K])):
        want = _l2norm(part.reshape(t, H, K)).to(dtype)
        torch.testing.assert_close(got.float(), want.float(), **tol)


def test_the_plain_prefill_gives_the_same_bits_with_short_and_long_tiles(monkeypatch):
    # 40 tokens at D = 256 take 4-token tiles at 132 SMs, 20,000 take 16-token ones: the
    # outputs of the first 40 tokens must not depend on the tile
    d, dtype = 256, torch.bfloat16
    weight, bias, state, x, cu, slots, _, _ = setup(d, 1, [20000], dtype, seed=3)
    kernels_emu.emulate(monkeypatch)
    short = causal_conv1d_prefill(x[:40], weight, bias, state.clone(),
                                  torch.tensor([0, 40], dtype=torch.int32), slots)
    long = causal_conv1d_prefill(x, weight, bias, state.clone(), cu, slots)
    assert torch.equal(short, long[:40])


def test_sizes_the_fused_kernel_cannot_take_run_the_conv_and_a_separate_norm(monkeypatch):
    d = 2 * 1 * 16 + 2 * 16  # D = 64: 8 threads of 8 bf16 channels, not a whole warp
    weight, bias, state, x, cu, slots, _, _ = setup(d, 1, [50], torch.bfloat16, seed=4)
    ref_state = state.clone()
    ops = kernels_emu.emulate(monkeypatch)
    q, k, v = conv_qkv_prefill(x, weight, bias, state, cu, slots, None, None, num_k_heads=1,
                               head_k_dim=16)
    y = conv1d_prefill_ref(x, weight, bias, ref_state, cu, slots)
    assert ops.calls == 1  # the plain conv kernel
    torch.testing.assert_close(q.float(), _l2norm(y[:, :16].reshape(50, 1, 16)).float(),
                               atol=8e-3, rtol=8e-3)
    assert torch.equal(v, y[:, 32:])


def test_bad_head_sizes_are_refused():
    weight, bias, state, x, cu, slots, _, _ = setup(64, 1, [5], torch.float32, seed=5)
    with pytest.raises(ValueError, match="must lie inside conv_dim"):
        conv_qkv_prefill(x, weight, bias, state, cu, slots, None, None, num_k_heads=2,
                         head_k_dim=16)
