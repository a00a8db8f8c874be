"""Dense projections: y = x Wᵀ (+ b), with a skinny-GEMM kernel for decode-sized batches.

At M <= 32 rows (decode, verify of a few requests) a projection is a stream of its weights, and
cuBLAS runs these shapes at a third of the copy bandwidth on the H200 (split-K tiles plus a
reduce kernel: issue 27). `linear` sends them to the extension's `gemv` (csrc/kernels/gemv.cuh:
one block per 8 output columns over all of K, tensor-core MMAs, one launch); every other input
runs `linear_ref` = `F.linear`, which is also the CPU path (bitwise what it was) and the oracle.

Contract of the kernel path: fp32 accumulation of exact products of the 16-bit inputs, the bias
added in fp32, one rounding to x's dtype. The order of the sums differs from cuBLAS (the warps
of a block each sum a part of K, then the parts are added in warp order), so the result is
equal to `F.linear` within that fp32 rounding plus one rounding of the output, not bitwise; the
same inputs give the same bits on every run.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from deltaserve.ops import _ext

KERNEL_MAX_ROWS = 32  # the kernel's limit: two 16-row MMAs per weight register
KERNEL_DTYPES = (torch.bfloat16, torch.float16)
# Above 8 rows the kernel wins only where its grid is one wave (N / 8 <= multiprocessors: the
# hidden-wide outputs, out_proj / o_proj / down_proj, one 16-warp block an SM reading x once).
# Wider grids re-read x per block: on an H100 (bench_linear, session 43) in_proj ran 0.92x of
# cuBLAS at 16 rows and 0.55x at 32, the LM head 0.91x / 0.57x, the 1024-column ones 1.39-1.57x
# at 16 and 1.13x at 32. So wider grids keep this limit (DS_GEMV_WIDE_MAX_ROWS=0..32 overrides,
# for A/B runs; read at import).
DEFAULT_WIDE_MAX_ROWS = 8
EMULATED_MULTIPROCESSORS = 132  # csrc/kernels/compat.cuh: the emulator reports an H100's SMs
# On by default on CUDA: on the H200 (2026-12-04) its 661 GPU test cases passed, and the 0.8B
# config's batch-1 decode went from 440 to 680 tok/s with it (benchmarks/RESULTS.md; cuBLAS runs
# these shapes as split-K tiles plus a reduce kernel at 0.7-1.4 TB/s). On ROCm the kernel's MMA
# is the portable shuffle form (correct, far slower than the tensor cores): off there.
# DS_GEMV_MAX_ROWS=0..32 overrides (0: every projection on cuBLAS / hipBLAS).
DEFAULT_MAX_ROWS = 0 if torch.version.hip else 32


def _max_rows_from_env(value: str | None, default: int = DEFAULT_MAX_ROWS) -> int:
    """DS_GEMV_MAX_ROWS: rows up to which the kernel runs, 0 (off) .. 32 (WIDE_MAX_ROWS bounds
    grids of more blocks than multiprocessors); unset: `default`."""
    return _ext.count_from_env("DS_GEMV_MAX_ROWS", default, KERNEL_MAX_ROWS, value or "")


def _wide_max_rows_from_env(value: str | None) -> int:
    """DS_GEMV_WIDE_MAX_ROWS: rows up to which grids of more blocks than multiprocessors take
    the kernel, 0 .. 32; unset: DEFAULT_WIDE_MAX_ROWS."""
    return _ext.count_from_env("DS_GEMV_WIDE_MAX_ROWS", DEFAULT_WIDE_MAX_ROWS, KERNEL_MAX_ROWS,
                               value or "")


# Read once at import (A/B runs set them before starting the process); 0 disables the kernel.
GEMV_MAX_ROWS = _max_rows_from_env(os.environ.get("DS_GEMV_MAX_ROWS"))
WIDE_MAX_ROWS = _wide_max_rows_from_env(os.environ.get("DS_GEMV_WIDE_MAX_ROWS"))


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x Wᵀ + b (`F.linear`'s contract).

    x [..., K] (bf16 / fp16 / fp32), weight [N, K], bias [N] or None, all one dtype ->
    y [..., N] in x's dtype. The gemv kernel runs when all are CUDA tensors of bf16 / fp16,
    the flattened rows M = x.numel() / K are 1 .. GEMV_MAX_ROWS, K % 8 == 0, the weight is
    contiguous and x's rows are dense and 16-byte aligned (a view of merged leading dims);
    its result is F.linear's up to fp32 sum order (module docstring). No host synchronisation
    and no allocation but the output: CUDA-graph capturable. Everything else is `F.linear`.
    x may also be an `ops.prologue.ProjectionInput` (an input whose op has not run yet): its
    `project` then runs the op as the gemv's prologue where it fits, else the op and this.
    Raises ValueError when weight is not 2-D or x's last dim is not K, or bias is not [N].
    """
    if not isinstance(x, torch.Tensor):  # an ops.prologue.ProjectionInput
        return x.project(weight, bias)
    if weight.dim() != 2 or x.dim() < 1 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"linear: x [..., K] and weight [N, K] do not match: "
                         f"{list(x.shape)} and {list(weight.shape)}")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != weight.shape[0]):
        raise ValueError(f"linear: bias must be [{weight.shape[0]}], got {list(bias.shape)}")
    if _gemv_fits(x, weight, bias):
        rows = _as_rows(x)
        if rows is not None:
            y = _ext.ops().gemv(rows, weight, bias)
            return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


def linear_ref(x: torch.Tensor, weight: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch linear (any device): `F.linear`."""
    return F.linear(x, weight, bias)


def _gemv_fits(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    k = weight.shape[1]
    return gemv_fits(x.numel() // k if k else 0, x.dtype, weight, bias, x)


def gemv_fits(rows: int, dtype: torch.dtype, weight: torch.Tensor, bias: torch.Tensor | None,
              *inputs: torch.Tensor) -> bool:
    """The gemv kernel's conditions on everything but x's layout: 1 .. GEMV_MAX_ROWS rows (at
    most WIDE_MAX_ROWS where N / 8 > the device's multiprocessors), a kernel dtype shared by
    the weight (and bias), K % 8 == 0, a contiguous 16-byte-aligned weight, every tensor
    (`inputs`: what x is read from) on the extension's device. Cheapest checks first: prefill
    and CPU calls leave at once (ops/prologue.py calls it per layer)."""
    k = weight.shape[1]
    return (0 < rows <= GEMV_MAX_ROWS and dtype in KERNEL_DTYPES and k % 8 == 0
            and (rows <= WIDE_MAX_ROWS or weight.shape[0] <= 8 * _multiprocessors(weight))
            and weight.shape[0] > 0 and weight.dtype == dtype
            and (bias is None or (bias.dtype == dtype and bias.is_contiguous()))
            and weight.is_contiguous() and weight.data_ptr() % 16 == 0
            and _ext.use_extension(weight, *inputs, *(() if bias is None else (bias,))))


def _multiprocessors(t: torch.Tensor) -> int:
    """Multiprocessors of t's device (EMULATED_MULTIPROCESSORS off CUDA: the CPU emulation)."""
    return _device_multiprocessors(t.device.index if t.is_cuda else -1)


@functools.cache
def _device_multiprocessors(index: int) -> int:
    if index < 0:
        return EMULATED_MULTIPROCESSORS
    return torch.cuda.get_device_properties(index).multi_processor_count


def _as_rows(x: torch.Tensor) -> torch.Tensor | None:
    """x [..., K] as the kernel's [M, K] rows (a view: dense rows, 16-byte aligned, whole
    16-byte words apart), or None where its leading dims do not merge or align."""
    try:
        rows = x.view(-1, x.shape[-1])
    except RuntimeError:  # leading dims with strides that do not merge
        return None
    ok = (rows.stride(1) == 1 and rows.data_ptr() % 16 == 0
          and (rows.shape[0] == 1 or rows.stride(0) % 8 == 0))
    return rows if ok else None
