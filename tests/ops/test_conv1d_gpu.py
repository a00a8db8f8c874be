"""CUDA causal conv1d kernels against the reference; verify/commit bitwise against update."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import (
    causal_conv1d_commit,
    causal_conv1d_prefill,
    causal_conv1d_update,
    causal_conv1d_verify,
)
from deltaserve.ops._ext import extension_loaded
from deltaserve.ops.conv1d import conv1d_prefill_ref, conv1d_update_ref, conv1d_verify_ref

pytestmark = pytest.mark.gpu
DEV, W = "cuda", 4


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


def _setup(d, num_slots, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(d, W, generator=gen) * 0.5).to(dtype).to(DEV)
    bias = (torch.randn(d, generator=gen) * 0.1).to(dtype).to(DEV)
    state = torch.randn(num_slots, W - 1, d, generator=gen).to(dtype).to(DEV)
    return gen, weight, bias, state


def _slots(n, num_slots, seed, pad_every=0):
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    if pad_every:
        slots[::pad_every] = 0
    return slots.int().to(DEV)


@pytest.mark.parametrize("n", [1, 8, 300, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_update_matches_the_reference_with_shuffled_and_padding_slots(n, dtype):
    d = 8192 if n <= 300 else 1024
    gen, weight, bias, state = _setup(d, n + 1, dtype, seed=n)
    x = torch.randn(n, d, generator=gen).to(dtype).to(DEV)
    slots = _slots(n, n + 1, seed=1, pad_every=5 if n > 4 else 0)
    ref = state.clone()
    y = causal_conv1d_update(x, weight, bias, state, slots)
    y_ref = conv1d_update_ref(x, weight, bias, ref, slots)
    real = (slots != 0).nonzero().flatten()
    # one ulp of a 16-bit output: the kernel's silu (hardware exp and reciprocal, a few ulp of
    # fp32) may round a 16-bit value the other way from the reference's
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y[real], y_ref[real], atol=tol, rtol=tol)
    assert torch.equal(state[1:], ref[1:])


def _verify_shape_requests(shape: str, dtype: torch.dtype, d: int) -> int:
    """Requests that put verify with R >= 4 in each of its launch shapes (conv1d.cuh,
    launch_conv_step): rows split over threads while the unsplit grid is under a quarter of a
    block per multiprocessor, rows loaded ahead up to 4 blocks per multiprocessor (at 1.5 and
    3), one row at a time with registers capped above that."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    per_req = d // (16 // dtype.itemsize) // 128  # unsplit blocks of 128 threads per request
    split = max(1, min(3, (sms - 1) // (4 * per_req)))  # 4 * blocks < sms where 1 request allows
    return {"split": split, "ahead": 3 * sms // (2 * per_req), "ahead_full": 3 * sms // per_req,
            "capped": 6 * sms // per_req}[shape]


@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("bias_on", [True, False])
@pytest.mark.parametrize("shape", ["split", "ahead", "ahead_full", "capped"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_verify_equals_stepwise_updates_bitwise_and_leaves_windows_untouched(rows, bias_on, shape,
                                                                            dtype):
    d = 2048
    n = _verify_shape_requests(shape, dtype, d)
    gen, weight, bias, state = _setup(d, n + 1, dtype, seed=rows)
    bias = bias if bias_on else None
    x = torch.randn(n, rows, d, generator=gen).to(dtype).to(DEV)
    slots = _slots(n, n + 1, seed=2)
    before = state.clone()
    y = causal_conv1d_verify(x, weight, bias, state, slots)
    assert torch.equal(state, before)
    stepped = state.clone()
    for r in range(rows):
        assert torch.equal(y[:, r], causal_conv1d_update(x[:, r], weight, bias, stepped, slots))
    torch.testing.assert_close(y, conv1d_verify_ref(x, weight, bias, before, slots), atol=1e-2,
                               rtol=1e-2)


@pytest.mark.parametrize("n", [1, 8, 200])
def test_verify_gives_the_same_bits_with_rows_split_or_not(n, monkeypatch):
    d, rows = 2048, 4
    gen, weight, bias, state = _setup(d, n + 1, torch.bfloat16, seed=n)
    x = torch.randn(n, rows, d, generator=gen).to(torch.bfloat16).to(DEV)
    slots = _slots(n, n + 1, seed=3)
    outs = []
    for split in ("1", "0"):
        monkeypatch.setenv("DS_CONV_SPLIT", split)
        outs.append(causal_conv1d_verify(x, weight, bias, state, slots))
    assert torch.equal(outs[0], outs[1])


@pytest.mark.parametrize("rows", [1, 3, 5, 8])
def test_commit_equals_n_updates_for_every_n(rows):
    n, d = rows + 1, 1024
    gen, weight, bias, state = _setup(d, 32, torch.bfloat16, seed=rows)
    x = torch.randn(n, rows, d, generator=gen).bfloat16().to(DEV)
    slots = _slots(n, 32, seed=3)
    accepted = torch.arange(n, dtype=torch.int32, device=DEV)  # 0..R
    stepped = state.clone()
    causal_conv1d_commit(x, state, slots, accepted)
    for i in range(n):
        for r in range(i):
            causal_conv1d_update(x[i:i + 1, r], weight, bias, stepped, slots[i:i + 1])
    assert torch.equal(state, stepped)


@pytest.mark.parametrize("lengths", [[1, 2, 0, 70, 5], [4096], [33] * 40])
def test_prefill_matches_the_reference_with_final_and_tracked_windows(lengths):
    d, dtype = 8192, torch.bfloat16
    n = len(lengths)
    gen, weight, bias, state = _setup(d, 2 * n + 2, dtype, seed=len(lengths))
    x = torch.randn(sum(lengths), d, generator=gen).to(dtype).to(DEV)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    slots = _slots(n, n + 1, seed=4)
    offsets = torch.tensor([ln // 2 for ln in lengths], dtype=torch.int32, device=DEV)
    track = torch.arange(n + 1, 2 * n + 1, dtype=torch.int32, device=DEV)
    track[::3] = 0  # no tracking for these
    ref = state.clone()
    y = causal_conv1d_prefill(x, weight, bias, state, cu, slots, offsets, track)
    y_ref = conv1d_prefill_ref(x, weight, bias, ref, cu, slots, offsets, track)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(state, ref)
