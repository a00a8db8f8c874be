"""The gemv kernel's own code (csrc/kernels/gemv.cuh), run on the CPU by the emulated device
runtime (kernels_emu.py) through `ops.linear.linear`, against the float64 product within the
kernel's contract (linear_inputs.py): M = 1 .. 8 and up to 32 (one or two 16-row MMAs a weight
register), N not a multiple of the 8-column tile, K a multiple of 8 that is not one of the
32-element warp chunk (8, 40, 264), with and without bias, bf16 and fp16, the three block shapes
(16, 8 and 4 warps: 528 blocks or more take 4 warps, as on an H200's 132 SMs), and x handed over
as a 3-D or a strided view. Sizes stay small (the emulator runs a block's threads as fibers);
tests/ops/test_linear_gpu.py owns the real ones."""

from __future__ import annotations

import re

import kernels_emu
import pytest
import torch
from linear_inputs import DTYPES, assert_matches_fp64, operands

from deltaserve.ops import linear as linear_ops


@pytest.fixture
def emu(monkeypatch):
    monkeypatch.setattr(linear_ops, "GEMV_MAX_ROWS", linear_ops.KERNEL_MAX_ROWS)  # ROCm: 0
    return kernels_emu.emulate(monkeypatch)


@pytest.fixture
def emu_all_grids(emu, monkeypatch):
    """The kernel at every row count on every grid (the engine keeps wide grids to 8 rows)."""
    monkeypatch.setattr(linear_ops, "WIDE_MAX_ROWS", linear_ops.KERNEL_MAX_ROWS)
    return emu


@pytest.mark.parametrize("m", [*range(1, 9), 9, 15, 16, 17, 31, 32])
@pytest.mark.parametrize("n,k", [(13, 8), (37, 40), (9, 264)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_gemv_matches_the_product_for_every_row_count(emu, m, n, k, bias, dtype):
    gen = torch.Generator().manual_seed(1000 * m + n + k)
    x, w, b = operands(m, n, k, dtype, gen, bias)
    y = linear_ops.linear(x, w, b)
    assert emu.calls == 1, "the wrapper ran F.linear, not the emulated kernel"
    assert_matches_fp64(y, x, w, b)


# 16 warps: K = 1032 gives every warp 2 chunks (warp 0 a third), K = 4104 a second round of
# loads (129 chunks > 8 x 16); N = 2113 -> 265 blocks (8 warps), 4229 -> 529 blocks (4 warps),
# K = 16 / 72: warps with no chunk, K = 264 / 136: warps with one chunk more than the others
@pytest.mark.parametrize("m,n,k", [(2, 9, 1032), (1, 5, 4104), (3, 2113, 16), (3, 2113, 264),
                                   (2, 4229, 72), (2, 4229, 136), (32, 9, 1032), (16, 5, 4104),
                                   (27, 2113, 264), (12, 4229, 72)])
def test_emulated_gemv_with_16_8_and_4_warp_blocks_matches(emu_all_grids, m, n, k):
    gen = torch.Generator().manual_seed(n)
    x, w, b = operands(m, n, k, torch.bfloat16, gen, bias=True)
    y = linear_ops.linear(x, w, b)
    assert emu_all_grids.calls == 1
    assert_matches_fp64(y, x, w, b)


@pytest.mark.parametrize("m,n,kernel", [(8, 2113, True), (9, 2113, False), (32, 1057, False),
                                        (9, 1056, True), (32, 1056, True)])
def test_more_than_8_rows_take_the_kernel_only_on_one_wave_grids(emu, m, n, kernel):
    # the emulator reports 132 multiprocessors: N <= 1056 is one block of 8 columns an SM
    gen = torch.Generator().manual_seed(m + n)
    x, w, b = operands(m, n, 16, torch.bfloat16, gen, bias=False)
    y = linear_ops.linear(x, w, b)
    assert emu.calls == int(kernel)
    if kernel:
        assert_matches_fp64(y, x, w, b)
    else:
        assert torch.equal(y, torch.nn.functional.linear(x, w, b))


def test_emulated_gemv_takes_3d_and_strided_views_of_x(emu):
    gen = torch.Generator().manual_seed(5)
    x, w, b = operands(0, 21, 48, torch.float16, gen, bias=False, lead=(2, 3))
    y = linear_ops.linear(x, w, b)
    assert y.shape == (2, 3, 21)
    assert_matches_fp64(y, x, w, b)
    wide = torch.randn(4, 64, generator=gen).to(torch.float16)
    xs = wide[:, :48]  # rows 64 elements apart: a column slice of a merged projection
    ys = linear_ops.linear(xs, w)
    assert_matches_fp64(ys, xs, w, None)
    assert emu.calls == 2


@pytest.mark.parametrize("m", [16, 32])
def test_emulated_gemv_row_bits_do_not_depend_on_the_rows_beside_it(emu, m):
    # 16 and 32 rows take one and two 16-row MMAs a weight register; 8 rows the 8-row form
    gen = torch.Generator().manual_seed(m)
    x, w, b = operands(m, 21, 264, torch.bfloat16, gen, bias=True)
    y = linear_ops.linear(x, w, b)
    for rows in (slice(0, 1), slice(0, 8), slice(m - 9, m)):
        assert torch.equal(y[rows], linear_ops.linear(x[rows], w, b))


def test_emulated_gemv_gives_the_same_bits_on_every_call(emu):
    gen = torch.Generator().manual_seed(9)
    x, w, b = operands(5, 70, 264, torch.bfloat16, gen, bias=True)
    assert torch.equal(linear_ops.linear(x, w, b), linear_ops.linear(x, w, b))


@pytest.mark.parametrize("case", ["fp32", "rows", "k", "misaligned", "disabled"])
def test_inputs_outside_the_kernel_run_f_linear(emu, monkeypatch, case):
    gen = torch.Generator().manual_seed(3)
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    m = 33 if case == "rows" else 2
    k = 36 if case == "k" else 32
    x, w, b = operands(m, 11, k, dtype, gen, bias=True)
    if case == "misaligned":  # rows start one element past a 16-byte boundary
        x = torch.randn(m * k + 1, generator=gen).to(dtype)[1:].view(m, k)
    if case == "disabled":
        monkeypatch.setattr(linear_ops, "GEMV_MAX_ROWS", 0)
    y = linear_ops.linear(x, w, b)
    assert emu.calls == 0
    assert torch.equal(y, torch.nn.functional.linear(x, w, b))


@pytest.mark.parametrize("case,message", [
    ("rows", "1 to 32 rows"), ("k", "multiple of 8"), ("weight", "weight must be contiguous"),
    ("dtype", "weight (x's dtype)"), ("bias", "bias must be"), ("misaligned", "16-byte aligned"),
    ("stride", "multiple of 8 apart")])
def test_emulated_gemv_binding_names_the_bad_argument(case, message):
    ops = kernels_emu.load()
    gen = torch.Generator().manual_seed(4)
    x, w, b = operands(33 if case == "rows" else 2, 16, 12 if case == "k" else 32,
                       torch.bfloat16, gen, bias=True)
    if case == "weight":  # column-major: not contiguous
        w = w.t().contiguous().t()
    if case == "dtype":
        w = w.half()
    if case == "bias":
        b = b[:8]
    if case == "misaligned":
        x = torch.randn(2 * 32 + 1, generator=gen).to(torch.bfloat16)[1:].view(2, 32)
    if case == "stride":
        x = torch.randn(2, 36, generator=gen).to(torch.bfloat16)[:, :32]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        ops.gemv(x, w, b)


def test_emulated_gemv_reads_a_broadcast_row_of_x(emu):
    gen = torch.Generator().manual_seed(8)
    _, w, b = operands(1, 19, 64, torch.bfloat16, gen, bias=True)
    x = torch.randn(1, 64, generator=gen).to(torch.bfloat16).expand(4, 64)  # row stride 0
    y = linear_ops.linear(x, w, b)
    assert emu.calls == 1
    assert_matches_fp64(y, x, w, b)
    assert torch.equal(y, y[:1].expand(4, 19))
