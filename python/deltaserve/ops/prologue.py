"""Projection inputs made inside the projection's kernel (the decode fast path, DESIGN.md).

A decode step runs, before most of its projections, one small kernel whose output only that
projection reads: silu·mul before down_proj, the sigmoid gate before o_proj, the GDN gated norm
before out_proj, and the residual add + RMSNorm before the next block's first projection. At
batch 1 each is a few microseconds of launch and dependency on the step's critical path. The
classes here stand for such an input, not yet computed; `ops.linear.linear` (so every
`Linear`, `MergedLinear` and tensor-parallel projection) accepts one in place of x and calls
its `project`, which runs the extension's gemv with the op as its prologue
(csrc/kernels/gemv_prologue.cuh: every block makes x in shared memory with the stand-alone
kernel's device code, then multiplies) where the inputs fit it, and elsewhere the two ops one
after the other (`materialize`, then `linear`): the pure-torch references on the CPU.

Contract: `project(w, b)` is bitwise `linear(materialize(), w, b)` wherever both run the
extension's kernels (same x bits, same products in the same order), so whether a call fits the
fused kernel never changes a result. Fits: CUDA, bf16 / fp16, M = 1 .. PROLOGUE_MAX_ROWS (8)
rows within gemv's own limits (ops/linear.py), M * (K + 8) <= 8,256 elements (the kernel's
shared-memory stage), views that allow 16-byte accesses, norm rows of at most 4,096 elements.
DS_GEMV_PROLOGUE=0 turns the fused kernels off (A/B runs), as DS_GEMV_MAX_ROWS=0 turns off gemv
itself.
"""

from __future__ import annotations

import torch

from deltaserve.ops import _ext, fused
from deltaserve.ops import linear as linear_ops

PROLOGUE_MAX_ROWS = 8  # csrc/kernels/gemv.cuh, kMaxStagedRows
STAGE_ELEMS = 8192 + 8 * PROLOGUE_MAX_ROWS  # csrc/kernels/gemv.cuh, kStageElems
MAX_NORM_ROW = 4096  # elements of a norm row the prologue takes (128 threads x 4 x 8)
PROLOGUE_ON = _ext.count_from_env("DS_GEMV_PROLOGUE", 1, 1) == 1


def _vec(t: torch.Tensor, piece: int, offset: int = 0) -> bool:
    """csrc/ops/common.h `vectors_fit`: 16-byte accesses from element `offset` of each row in
    pieces of `piece` elements."""
    n = 16 // t.element_size()
    return (piece % n == 0 and offset % n == 0 and t.data_ptr() % 16 == 0
            and all(s % n == 0 for s in t.stride()[:-1]))


def _kernel_fits(x: torch.Tensor, m: int, k: int, weight: torch.Tensor,
                 bias: torch.Tensor | None, *inputs: torch.Tensor) -> bool:
    """The gemv prologue kernels take these: gemv's own conditions for M rows of K
    (`linear.gemv_fits`, cheapest first: a prefill or CPU call leaves at once) and the stage's
    size."""
    return (PROLOGUE_ON and m <= PROLOGUE_MAX_ROWS and m * (k + 8) <= STAGE_ELEMS
            and weight.dim() == 2
            and weight.shape[1] == k and linear_ops.gemv_fits(m, x.dtype, weight, bias, x, *inputs))


def _norm_weight_ok(w: torch.Tensor, d: int, dtype: torch.dtype) -> bool:
    """A norm weight the prologue reads with 16-byte loads: [d] of `dtype`, dense, aligned, and
    a row short enough for the prologue's 128 threads."""
    return (d <= MAX_NORM_ROW and w.dtype == dtype and w.shape == (d,) and w.is_contiguous()
            and w.data_ptr() % 16 == 0)


class ProjectionInput:
    """x [M, K] of a projection, made by an op that has not run yet. `shape`, `dtype` and
    `device` are x's; `materialize()` runs the op (its fused.py wrapper) and returns x;
    `project(weight [N, K], bias [N] | None)` returns y [M, N] = x Wᵀ + b in x's dtype."""

    shape: torch.Size
    dtype: torch.dtype
    device: torch.device

    def materialize(self) -> torch.Tensor:
        raise NotImplementedError

    def _fused(self, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
        """y from the extension's fused kernel, or None where the inputs do not fit it."""
        raise NotImplementedError

    def project(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if weight.dim() != 2 or weight.shape[1] != self.shape[-1]:
            raise ValueError(f"linear: x [..., K] and weight [N, K] do not match: "
                             f"{list(self.shape)} and {list(weight.shape)}")
        y = self._fused(weight, bias)
        return y if y is not None else linear_ops.linear(self.materialize(), weight, bias)


class SiluMul(ProjectionInput):
    """x = fused.silu_mul(gate_up): gate_up [T, 2I] (rows may be strided) -> x [T, I]."""

    def __init__(self, gate_up: torch.Tensor) -> None:
        if gate_up.dim() != 2 or gate_up.shape[-1] % 2:
            raise ValueError(f"gate_up must be [T, 2I], got shape {list(gate_up.shape)}")
        self.gate_up = gate_up
        self.shape = torch.Size((gate_up.shape[0], gate_up.shape[1] // 2))
        self.dtype, self.device = gate_up.dtype, gate_up.device

    def materialize(self) -> torch.Tensor:
        return fused.silu_mul(self.gate_up)

    def _fused(self, weight, bias):
        m, i = self.shape
        g = self.gate_up
        if _kernel_fits(g, m, i, weight, bias) and g.stride(-1) == 1 and _vec(g, i, i):
            return _ext.ops().silu_mul_gemv(g, weight, bias)
        return None


class SigmoidGateMul(ProjectionInput):
    """x = fused.sigmoid_gate_mul(o, q_gate): o [T, Hq, D], q_gate [T, Hq, 2D] -> x [T, Hq·D]."""

    def __init__(self, o: torch.Tensor, q_gate: torch.Tensor) -> None:
        if o.dim() != 3 or q_gate.dim() != 3 or q_gate.shape[:2] != o.shape[:2] \
                or q_gate.shape[2] != 2 * o.shape[2]:
            raise ValueError("o must be [T, Hq, D] and q_gate [T, Hq, 2D], got "
                             f"{list(o.shape)} and {list(q_gate.shape)}")
        self.o, self.q_gate = o, q_gate
        self.shape = torch.Size((o.shape[0], o.shape[1] * o.shape[2]))
        self.dtype, self.device = o.dtype, o.device

    def materialize(self) -> torch.Tensor:
        return fused.sigmoid_gate_mul(self.o, self.q_gate)

    def _fused(self, weight, bias):
        o, qg = self.o, self.q_gate
        m, k = self.shape
        d = o.shape[2]
        if (_kernel_fits(o, m, k, weight, bias, qg) and o.stride(-1) == 1
                and qg.stride(-1) == 1 and qg.dtype == o.dtype and _vec(o, d) and _vec(qg, d, d)):
            return _ext.ops().sigmoid_gate_mul_gemv(o, qg, weight, bias)
        return None


class GatedRMSNorm(ProjectionInput):
    """x = fused.gated_rms_norm(o, z, gated_weight, eps): o, z [T, HV, V] -> x [T, HV·V]."""

    def __init__(self, o: torch.Tensor, z: torch.Tensor, gated_weight: torch.Tensor,
                 eps: float) -> None:
        if o.dim() != 3 or z.shape != o.shape:
            raise ValueError(f"o and z must both be [T, HV, V], got {list(o.shape)} and "
                             f"{list(z.shape)}")
        self.o, self.z, self.gated_weight, self.eps = o, z, gated_weight, eps
        self.shape = torch.Size((o.shape[0], o.shape[1] * o.shape[2]))
        self.dtype, self.device = o.dtype, o.device

    def materialize(self) -> torch.Tensor:
        return fused.gated_rms_norm(self.o, self.z, self.gated_weight, self.eps)

    def _fused(self, weight, bias):
        o, z, gw = self.o, self.z, self.gated_weight
        m, k = self.shape
        v = o.shape[2]
        if (_kernel_fits(o, m, k, weight, bias, z, gw) and _norm_weight_ok(gw, v, o.dtype)
                and o.stride(-1) == 1 and z.stride(-1) == 1 and z.dtype == o.dtype
                and _vec(o, v) and _vec(z, v)):
            return _ext.ops().gated_rms_norm_gemv(o, z, gw, self.eps, weight, bias)
        return None


class AddRMSNorm(ProjectionInput):
    """The pre-norm of a residual block, fused.add_rms_norm(h, residual, rms_weight, eps):
    x = norm(s), s = residual + h; h, residual [T, D] -> x [T, D]. `sum` is s, set by
    `project` or `materialize` (whichever runs first; the next block adds to it)."""

    def __init__(self, h: torch.Tensor, residual: torch.Tensor, rms_weight: torch.Tensor,
                 eps: float) -> None:
        if h.dim() != 2 or residual.shape != h.shape:
            raise ValueError(f"h and residual must both be [T, D], got {list(h.shape)} and "
                             f"{list(residual.shape)}")
        self.h, self.residual, self.rms_weight, self.eps = h, residual, rms_weight, eps
        self.shape, self.dtype, self.device = h.shape, h.dtype, h.device
        self._x: torch.Tensor | None = None
        self._sum: torch.Tensor | None = None

    @property
    def sum(self) -> torch.Tensor:
        """s [T, D] in h's dtype. Raises RuntimeError before `project` or `materialize` ran."""
        if self._sum is None:
            raise RuntimeError("AddRMSNorm.sum is made by its projection: project or "
                               "materialize it first")
        return self._sum

    def materialize(self) -> torch.Tensor:
        if self._x is None:
            self._x, self._sum = fused.add_rms_norm(self.h, self.residual, self.rms_weight,
                                                    self.eps)
        return self._x

    def _fused(self, weight, bias):
        h, r, w = self.h, self.residual, self.rms_weight
        m, d = self.shape
        if (self._sum is None and _kernel_fits(h, m, d, weight, bias, r, w)
                and _norm_weight_ok(w, d, torch.float32) and h.stride(-1) == 1
                and r.stride(-1) == 1 and r.dtype == h.dtype and _vec(h, d) and _vec(r, d)):
            y, self._sum = _ext.ops().add_rms_norm_gemv(h, r, w, self.eps, weight, bias)
            return y
        return None


def as_tensor(x: torch.Tensor | ProjectionInput) -> torch.Tensor:
    """x itself, or the input a ProjectionInput stands for (computed once)."""
    return x.materialize() if isinstance(x, ProjectionInput) else x
