"""The projection-prologue kernels (csrc/kernels/gemv_prologue.cuh) run on the CPU by the
emulated device runtime (kernels_emu.py) through `ops.prologue`: each equals the stand-alone op
followed by gemv bit for bit (the contract), for M = 1 .. 8 rows, bf16 and fp16, the three
block shapes (16, 8 and 4 warps), norm rows taken by 16, 32 and 128 threads, strided views as
the model hands them over; inputs that do not fit fall back to the same pair; the wrappers'
argument errors. tests/ops/test_prologue_gpu.py runs the same cases on the GPU."""

from __future__ import annotations

import kernels_emu
import pytest
import torch
from prologue_inputs import KINDS, check, make

from deltaserve.ops import linear as linear_ops
from deltaserve.ops import prologue


@pytest.fixture
def emu(monkeypatch):
    monkeypatch.setattr(linear_ops, "GEMV_MAX_ROWS", linear_ops.KERNEL_MAX_ROWS)  # ROCm: 0
    monkeypatch.setattr(prologue, "PROLOGUE_ON", True)
    return kernels_emu.emulate(monkeypatch)


# (heads, head_dim) of K: norm rows of 32 elements (16 threads), 256 (32), 2048 (128: 4 warps
# summed through shared memory); N = 24 -> 3 blocks of 16 warps, 1100 -> 138 (8), 4300 -> 538 (4)
SHAPES = {"silu_mul": [((1, 64), 24), ((1, 1000), 24)],
          "sigmoid_gate_mul": [((4, 32), 24), ((2, 64), 1100)],
          "gated_rms_norm": [((4, 32), 24), ((2, 256), 24)],
          "add_rms_norm": [((1, 256), 24), ((1, 1024), 24), ((1, 64), 4300)]}


@pytest.mark.parametrize("m,dtype", [(1, torch.bfloat16), (3, torch.bfloat16),
                                     (8, torch.bfloat16), (2, torch.float16)])
@pytest.mark.parametrize("kind", KINDS)
def test_emulated_prologue_equals_the_op_then_gemv(emu, kind, m, dtype):
    for i, (k_shape, n) in enumerate(SHAPES[kind]):
        if m * (k_shape[0] * k_shape[1] + 8) > prologue.STAGE_ELEMS:
            continue
        gen = torch.Generator().manual_seed(100 * m + i)
        inp, w, b = make(kind, m, k_shape, n, dtype, gen, bias=i % 2 == 1)
        check(inp, w, b)
    assert emu.by_op.get(f"{kind}_gemv", 0) >= 1


def test_emulated_add_rms_norm_with_128_thread_rows_and_several_rows_a_block(emu):
    # D = 2048: a row is 4 warps; a 16-warp block sums 4 rows side by side, 8 rows in 2 rounds
    gen = torch.Generator().manual_seed(7)
    inp, w, b = make("add_rms_norm", 4, (1, 2048), 24, torch.bfloat16, gen)
    check(inp, w, b)
    assert emu.by_op["add_rms_norm_gemv"] == 1


@pytest.mark.parametrize("kind", KINDS)
def test_inputs_past_the_stage_take_the_unfused_pair(emu, kind):
    gen = torch.Generator().manual_seed(3)
    inp, w, b = make(kind, 8, (4, 264), 16, torch.bfloat16, gen)  # 8 x (1056 + 8) > 8256
    assert inp._fused(w, b) is None
    y = linear_ops.linear(inp, w, b)
    assert emu.by_op.get(f"{kind}_gemv", 0) == 0
    fresh, _, _ = make(kind, 8, (4, 264), 16, torch.bfloat16, torch.Generator().manual_seed(3))
    assert torch.equal(y, linear_ops.linear(fresh.materialize(), w, b))


@pytest.mark.parametrize("kind", KINDS)
def test_more_rows_than_a_prologue_stages_take_the_unfused_pair_through_gemv(emu, kind):
    # 9 rows of a small K fit the stage's elements but not its 8 rows: op, then plain gemv
    gen = torch.Generator().manual_seed(5)
    inp, w, b = make(kind, 9, (1, 32), 16, torch.bfloat16, gen)
    assert inp._fused(w, b) is None
    y = linear_ops.linear(inp, w, b)
    assert emu.by_op.get(f"{kind}_gemv", 0) == 0 and emu.by_op["gemv"] == 1
    fresh, _, _ = make(kind, 9, (1, 32), 16, torch.bfloat16, torch.Generator().manual_seed(5))
    assert torch.equal(y, linear_ops.linear(fresh.materialize(), w, b))


def test_prologue_off_runs_the_pair(emu, monkeypatch):
    monkeypatch.setattr(prologue, "PROLOGUE_ON", False)
    inp, w, b = make("silu_mul", 2, (1, 64), 24, torch.bfloat16, torch.Generator().manual_seed(1))
    y = linear_ops.linear(inp, w, b)
    assert "silu_mul_gemv" not in emu.by_op and emu.by_op["silu_mul"] == 1
    assert torch.equal(y, linear_ops.linear(inp.materialize(), w, b))


def test_add_rms_norm_sum_exists_only_after_its_projection():
    h, r = torch.randn(2, 16), torch.randn(2, 16)
    inp = prologue.AddRMSNorm(h, r, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="made by its projection"):
        _ = inp.sum
    y = linear_ops.linear(inp, torch.eye(16))  # CPU: the pure-torch pair
    torch.testing.assert_close(inp.sum, h + r)
    torch.testing.assert_close(y, inp.materialize())


@pytest.mark.parametrize("make_bad,match", [
    (lambda: prologue.SiluMul(torch.zeros(2, 7)), r"gate_up must be \[T, 2I\]"),
    (lambda: prologue.SigmoidGateMul(torch.zeros(2, 3, 4), torch.zeros(2, 3, 4)), "q_gate"),
    (lambda: prologue.GatedRMSNorm(torch.zeros(2, 3, 4), torch.zeros(2, 3, 5), torch.ones(4),
                                   1e-6), "both be"),
    (lambda: prologue.AddRMSNorm(torch.zeros(2, 4), torch.zeros(3, 4), torch.ones(4), 1e-6),
     "both be"),
])
def test_bad_shapes_raise_value_errors(make_bad, match):
    with pytest.raises(ValueError, match=match):
        make_bad()


def test_a_weight_of_the_wrong_width_raises_before_any_kernel(emu):
    inp = prologue.SiluMul(torch.zeros(2, 16, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="do not match"):
        linear_ops.linear(inp, torch.zeros(4, 9, dtype=torch.bfloat16))
    assert emu.calls == 0
