"""Inputs for the projection-prologue tests (ops/prologue.py), emulated on CPU and on the GPU:
each case builds a ProjectionInput from views shaped as the model hands them over (z and the
query gate as column slices of a merged projection's output, gate_up rows of a wider buffer),
fresh random values from `gen`, and a projection weight and bias.

`check(inp, w, b)` asserts the contract: the fused kernel ran (`_fused` gave a result) and its
output is bitwise the unfused pair's (`linear(materialize())`), sum included for AddRMSNorm.
"""

from __future__ import annotations

import torch

from deltaserve.ops import linear as linear_ops
from deltaserve.ops import prologue

KINDS = ("silu_mul", "sigmoid_gate_mul", "gated_rms_norm", "add_rms_norm")


def _rand(gen, *shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(dtype).to(device)


def make(kind: str, m: int, k_shape: tuple[int, int], n: int, dtype, gen: torch.Generator,
         device="cpu", bias: bool = False):
    """(ProjectionInput, weight [n, K], bias [n] or None) for `kind` with M = m rows;
    k_shape = (heads, head_dim) of x's K = heads * head_dim (silu / add: (1, K))."""
    heads, hd = k_shape
    k = heads * hd
    if kind == "silu_mul":
        wide = _rand(gen, m, 2 * k + 16, dtype=dtype, device=device)  # rows 16 elements longer
        inp = prologue.SiluMul(wide[:, :2 * k])
    elif kind == "sigmoid_gate_mul":
        qkv = _rand(gen, m, heads * 2 * hd + 3 * 8, dtype=dtype, device=device)
        q_gate = qkv[:, :heads * 2 * hd].view(m, heads, 2 * hd)
        inp = prologue.SigmoidGateMul(_rand(gen, m, heads, hd, dtype=dtype, device=device), q_gate)
    elif kind == "gated_rms_norm":
        conv = 2 * 8 * heads
        proj = _rand(gen, m, conv + k + 16, dtype=dtype, device=device)  # + b, a
        z = proj[:, conv:conv + k].view(m, heads, hd)
        o = _rand(gen, m, heads, hd, dtype=dtype, device=device, scale=0.3)
        w_norm = _rand(gen, hd, dtype=dtype, device=device, scale=0.5) + 1
        inp = prologue.GatedRMSNorm(o, z, w_norm.to(dtype), 1e-6)
    elif kind == "add_rms_norm":
        h = _rand(gen, m, k, dtype=dtype, device=device)
        residual = _rand(gen, m, k, dtype=dtype, device=device, scale=2.0)
        w_norm = (torch.randn(k, generator=gen) * 0.1 + 1).to(device)  # fp32 = 1 + w
        inp = prologue.AddRMSNorm(h, residual, w_norm, 1e-6)
    else:
        raise ValueError(kind)
    w = _rand(gen, n, k, dtype=dtype, device=device, scale=k ** -0.5)
    b = _rand(gen, n, dtype=dtype, device=device) if bias else None
    return inp, w, b


def check(inp: prologue.ProjectionInput, w: torch.Tensor, b: torch.Tensor | None) -> None:
    """The fused kernel ran and equals the unfused pair bit for bit (module docstring)."""
    y = inp._fused(w, b)
    assert y is not None, "the inputs did not fit the fused kernel"
    assert y.shape == (inp.shape[0], w.shape[0]) and y.dtype == inp.dtype
    fused_sum = inp.sum if isinstance(inp, prologue.AddRMSNorm) else None
    if fused_sum is not None:
        inp._sum = None  # materialize again: the unfused add_rms_norm
    x = inp.materialize()
    expect = linear_ops.linear(x, w, b)
    assert torch.equal(y, expect), (y.float() - expect.float()).abs().max().item()
    if fused_sum is not None:
        assert torch.equal(fused_sum, inp.sum)
