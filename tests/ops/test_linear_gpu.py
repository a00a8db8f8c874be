"""The gemv kernel (csrc/kernels/gemv.cuh) on the GPU through ops.linear.linear: bf16 / fp16,
M = 1 .. 8, N of 1 and one past a multiple of the 8-column tile at the three block shapes of an
H200 (1027: 129 blocks, 16 warps; 2051: 257 blocks, 8 warps; 8223: 1028 blocks, 4 warps), K in
{8, 1024, 2048, 3584, 4104}, with and without bias; the 0.8B config's projections and its LM
head; CUDA-graph capture. Against the float64 product within the kernel's contract
(linear_inputs.py: half an ulp of the output plus the fp32 sum bound K·2^-22·Σ|x w|). Inputs
are fresh each run (the seed is printed, so a failure can be replayed with LINEAR_SEED=<seed>).
"""

from __future__ import annotations

import os

import kernels_emu
import pytest
import torch
from linear_inputs import DTYPES, assert_matches_fp64, operands

from deltaserve.ops import _ext
from deltaserve.ops import linear as linear_ops
from deltaserve.ops._ext import extension_loaded

pytestmark = pytest.mark.gpu
DEV = "cuda"
# (N, K) of the 0.8B config: GDN in_proj / out_proj, MLP gate_up / down, attention qkv / o
MODEL_SHAPES = [(8224, 1024), (1024, 2048), (7168, 1024), (1024, 3584), (5120, 1024)]


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("LINEAR_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"LINEAR_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def counted(monkeypatch):
    """The extension's ops, counting calls: a test can tell the kernel ran, not F.linear."""
    ops = kernels_emu.CountingOps(torch.ops.deltaserve)
    monkeypatch.setattr(_ext, "ops", lambda: ops)
    monkeypatch.setattr(linear_ops, "GEMV_MAX_ROWS", linear_ops.KERNEL_MAX_ROWS)
    # every row count on every grid (the engine keeps grids wider than a wave to 8 rows)
    monkeypatch.setattr(linear_ops, "WIDE_MAX_ROWS", linear_ops.KERNEL_MAX_ROWS)
    return ops


@pytest.mark.parametrize("m", [*range(1, 9), 9, 16, 17, 24, 32])
@pytest.mark.parametrize("n", [1, 1027, 2051, 8223])
@pytest.mark.parametrize("k", [8, 1024, 2048, 3584, 4104])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_the_product(m, n, k, bias, dtype, gen, counted):
    x, w, b = operands(m, n, k, dtype, gen, bias, DEV)
    y = linear_ops.linear(x, w, b)
    assert counted.calls == 1, "F.linear ran, not the kernel"
    assert_matches_fp64(y, x, w, b)


@pytest.mark.parametrize("n,k", MODEL_SHAPES + [(248320, 1024)])
@pytest.mark.parametrize("m", [1, 4, 8, 16, 32])
def test_gemv_matches_at_the_model_shapes(n, k, m, gen, counted):
    x, w, _ = operands(m, n, k, torch.bfloat16, gen, False, DEV)
    y = linear_ops.linear(x, w)
    assert counted.calls == 1
    assert_matches_fp64(y, x, w, None)


def test_gemv_takes_views_of_merged_leading_dims_and_column_slices(gen, counted):
    x, w, b = operands(0, 1000, 512, torch.bfloat16, gen, True, DEV, lead=(2, 4))
    assert_matches_fp64(linear_ops.linear(x, w, b), x, w, b)
    wide = torch.randn(3, 1024, generator=gen).to(DEV, torch.bfloat16)
    xs = wide[:, 256:768]  # 16-byte aligned rows 1024 elements apart
    assert_matches_fp64(linear_ops.linear(xs, w, b), xs, w, b)
    assert counted.calls == 2


def test_gemv_captures_in_a_cuda_graph_and_replays_equal(gen, counted):
    shapes = MODEL_SHAPES[:2]
    ws = [operands(1, n, k, torch.bfloat16, gen, False, DEV)[1] for n, k in shapes]
    xs = [torch.randn(m, k, generator=gen).to(DEV, torch.bfloat16)
          for m in (1, 8) for _, k in shapes]
    calls = [(x, w) for x, w in zip(xs, ws + ws, strict=True)]
    eager = [linear_ops.linear(x, w) for x, w in calls]  # also the warm-up
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [linear_ops.linear(x, w) for x, w in calls]
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(outs, eager, strict=True):
        assert torch.equal(got, want), "a replay differs from the eager call"
    for x, _ in calls:  # new inputs in place: the replay reads them
        x.copy_(torch.randn(x.shape, generator=gen).to(x))
    graph.replay()
    torch.cuda.synchronize()
    for (x, w), got in zip(calls, outs, strict=True):
        assert torch.equal(got, linear_ops.linear(x, w))
    assert counted.calls == 3 * len(calls)


@pytest.mark.parametrize("n,k", [MODEL_SHAPES[0], MODEL_SHAPES[3]])  # 4 and 16 warps a block
@pytest.mark.parametrize("m", [16, 32])
def test_gemv_row_bits_do_not_depend_on_the_rows_beside_it(m, n, k, gen, counted):
    x, w, _ = operands(m, n, k, torch.bfloat16, gen, False, DEV)
    y = linear_ops.linear(x, w)
    for rows in (slice(0, 1), slice(0, 8), slice(m - 9, m)):
        assert torch.equal(y[rows], linear_ops.linear(x[rows], w))


def test_rows_past_the_limit_and_fp32_run_f_linear(gen, counted):
    x, w, b = operands(33, 64, 128, torch.bfloat16, gen, True, DEV)
    assert torch.equal(linear_ops.linear(x, w, b), torch.nn.functional.linear(x, w, b))
    x32, w32 = x.float(), w.float()
    assert torch.equal(linear_ops.linear(x32, w32), torch.nn.functional.linear(x32, w32))
    assert counted.calls == 0
