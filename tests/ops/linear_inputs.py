"""Inputs and the tolerance for the linear (gemv) tests, emulated on CPU and on the GPU.

The kernel sums exact products of 16-bit inputs in fp32, adds the bias in fp32 and rounds once
to the output dtype (deltaserve/ops/linear.py). Against the product in float64, an output may
then be off by the fp32 sum error, at most about K·u·Σ|x_k w_k| for u = 2^-24 (Higham, "Accuracy
and Stability of Numerical Algorithms", 2nd ed., section 4.2; here with 4x margin for a tensor
core that truncates instead of rounding inside its adds), plus half an ulp of the output dtype
(relative 2^-8 for bf16, 2^-11 for fp16, and half the smallest fp16 subnormal near zero).
"""

from __future__ import annotations

import torch

DTYPES = (torch.bfloat16, torch.float16)
HALF_ULP = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}
FLOOR = {torch.bfloat16: 2.0 ** -133, torch.float16: 2.0 ** -25}


def operands(m: int, n: int, k: int, dtype, gen: torch.Generator, bias: bool, device="cpu",
             lead: tuple[int, ...] | None = None):
    """x [*lead, K] (lead defaults to (m,)), weight [N, K] ~ N(0, 1/K) and bias [N] or None,
    in `dtype` on `device`: activations of unit scale, outputs of unit scale."""
    lead = (m,) if lead is None else lead
    x = torch.randn(*lead, k, generator=gen).to(dtype).to(device)
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).to(dtype).to(device)
    b = torch.randn(n, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


def assert_matches_fp64(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                        b: torch.Tensor | None) -> None:
    """y = x wᵀ + b within the kernel's contract (module docstring), element by element."""
    assert y.dtype == x.dtype and y.shape == (*x.shape[:-1], w.shape[0])
    k = w.shape[1]
    x64, w64 = x.double(), w.double()
    ref = x64 @ w64.T
    mag = x64.abs() @ w64.abs().T
    if b is not None:
        ref = ref + b.double()
        mag = mag + b.double().abs()
    tol = HALF_ULP[y.dtype] * ref.abs() + 1.01 * k * 2.0 ** -22 * mag + FLOOR[y.dtype]
    err = (y.double() - ref).abs()
    bad = err > tol
    assert not bad.any(), (f"{int(bad.sum())} of {y.numel()} outputs off: worst "
                           f"{float((err / tol).max()):.2f}x the tolerance")
