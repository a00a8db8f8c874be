"""Inputs and the tolerance for the MoE decode kernels' tests, emulated on CPU and on the GPU.

The kernels (deltaserve/ops/moe_fused.py) round gate, up and h to T where the reference does and
sum in fp32 in another order, so an output differs from `moe_fused_reference` by the fp32 sums'
error plus, where that order moves a gate / up / h value across a rounding point of T, one ulp
of that value (times a down weight); the output is rounded once. Bound used: two ulps of T of
the reference value plus a twentieth of an ulp of the largest output.
"""

from __future__ import annotations

import torch


def block_inputs(t: int, e: int, h: int, i: int, si: int, gen: torch.Generator,
                 dtype=torch.bfloat16, device="cpu"):
    """x [T, H] and logits [T, E (+1 with a shared expert)] of unit scale; gate_up [E, 2I, H],
    down [E, H, I] and, for si > 0, the shared expert's [2si, H] / [H, si] ~ N(0, 1/fan-in)
    (else None, None); all `dtype` on `device`, drawn on the CPU from `gen`."""

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)

    x = rnd(t, h)
    logits = rnd(t, e + (si > 0))
    gate_up, down = rnd(e, 2 * i, h, scale=h ** -0.5), rnd(e, h, i, scale=i ** -0.5)
    shared = (rnd(2 * si, h, scale=h ** -0.5), rnd(h, si, scale=si ** -0.5)) if si else (None, None)
    return x, logits, gate_up, down, *shared


def assert_close_to_reference(got: torch.Tensor, want: torch.Tensor) -> None:
    """got within the kernels' contract of want (module docstring), element by element."""
    assert got.dtype == want.dtype and got.shape == want.shape
    ulp = 2.0 ** (-7 if got.dtype == torch.bfloat16 else -10)
    err = (got.float() - want.float()).abs()
    # one ulp of h flipped by another fp32 sum order moves an output by ~ulp(h)|down|, far
    # below its own ulp unless the k slots cancel: the absolute term (0.1 ulp of the largest
    # output; 0.05 failed 1 of 256 x 2048 outputs by 7% on the H200) covers such outputs
    tol = 2 * ulp * want.float().abs() + ulp * 0.1 * want.float().abs().max()
    assert (err <= tol).all(), f"worst {float((err / tol).max()):.2f}x the tolerance"
