"""Input builders for the fused-op tests (emulated on CPU and on the GPU): activations as the
model hands them over, i.e. views into the merged projections' outputs, and the layouts that
send the kernels down their vector or element-wise paths."""

from __future__ import annotations

import torch

# One ulp of a 16-bit output, twice: the kernels round where the references round, so they
# differ only where the fp32 sum order moves a value across a rounding boundary (one ulp),
# which a later rounding step may carry into the output (a second).
TOL = {torch.bfloat16: 2 * 2.0 ** -8, torch.float16: 2 * 2.0 ** -11, torch.float32: 2e-5}
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
LAYOUTS = ("dense", "strided", "misaligned")


def close(actual: torch.Tensor, expect: torch.Tensor, scale: float = 1.0) -> None:
    """actual equals expect within scale x TOL of its dtype (relative and absolute)."""
    assert actual.dtype == expect.dtype and actual.shape == expect.shape
    assert actual.is_contiguous()
    tol = TOL[expect.dtype] * scale
    torch.testing.assert_close(actual, expect, atol=tol, rtol=tol)


def rows(t: int, d: int, dtype, layout: str, gen: torch.Generator, device="cpu",
         scale: float = 1.0) -> torch.Tensor:
    """[t, d] rows: dense; `strided` (every row inside a wider buffer, 16-byte aligned: the
    vector path); `misaligned` (one element off a 16-byte boundary: the element path)."""
    pad = {"dense": 0, "strided": 24, "misaligned": 3}[layout]
    buf = (torch.randn(t * (d + pad) + 1, generator=gen) * scale).to(dtype).to(device)
    start = 1 if layout == "misaligned" else 0
    return buf[start:start + t * (d + pad)].view(t, d + pad)[:, :d]


def norm_weight(d: int, gen: torch.Generator, dtype=torch.float32, device="cpu"):
    """1 + w of a zero-centred RMSNorm (w small), or w of the gated norm: [d]."""
    return (1 + 0.1 * torch.randn(d, generator=gen)).to(dtype).to(device)


def gdn_projection(t: int, hv: int, v: int, dtype, gen: torch.Generator, device="cpu"):
    """(x [t, hv, v] the recurrence output, z [t, hv, v] a view into the merged projection
    [t, q|k|v|z|b|a], rows 4·hv·v + 2·hv wide (8224 at the 0.8B config))."""
    width = 4 * hv * v + 2 * hv
    proj = (torch.randn(t, width, generator=gen) * 2).to(dtype).to(device)
    z = proj[:, 3 * hv * v:4 * hv * v].view(t, hv, v)
    x = torch.randn(t, hv, v, generator=gen).to(dtype).to(device)
    return x, z


def attention_projection(t: int, hq: int, hkv: int, d: int, dtype, gen: torch.Generator,
                         device="cpu"):
    """(q_gate [t, hq, 2d], k [t, hkv, d]) views into the merged [t, q+gate | k | v] output."""
    proj = (torch.randn(t, 2 * hq * d + 2 * hkv * d, generator=gen) * 3).to(dtype).to(device)
    q_gate = proj[:, :2 * hq * d].view(t, hq, 2 * d)
    k = proj[:, 2 * hq * d:2 * hq * d + hkv * d].view(t, hkv, d)
    return q_gate, k


def rope(t: int, rot: int, dtype, gen: torch.Generator, device="cpu", theta: float = 1e7):
    """cos, sin [t, rot] (rotate-half layout: each half repeats the frequencies) at random
    positions, in the activation dtype (as RotaryEmbedding returns them)."""
    pos = torch.randint(0, 8192, (t,), generator=gen).float()
    inv = theta ** (-torch.arange(0, rot, 2).float() / rot)
    freqs = torch.outer(pos, inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).to(device), emb.sin().to(dtype).to(device)
