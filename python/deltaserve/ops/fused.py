"""Fused element-wise and row-norm ops of the decoder layers (the fast path, DESIGN.md).

Each function is the contract of one kernel of the extension and, as written here, its
pure-torch reference: the CPU path and the oracle the GPU kernels are tested against. The
references keep the rounding points of the unfused model code they replace (transformers'
`Qwen3_5RMSNorm`, `Qwen3_5RMSNormGated`, `apply_rotary_pos_emb`, `Qwen3_5MLP`), so the CPU fp32
path still matches transformers token for token. A CUDA kernel keeps fp32 inside a row and
rounds once at each output; against these references it is close (bf16 / fp16 tolerance), not
bitwise.

Weights are prepared once at load time (model/prepare.py), never cast per call:
- `rms_weight` [D] fp32 holds 1 + w of a zero-centred RMSNorm (Qwen3.5's x̂ · (1 + w));
- `gated_weight` [V] in the activation dtype holds w of the GDN gated norm (not zero-centred).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, rms_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: y = x̂ · rms_weight, x̂ = x / sqrt(mean(x², -1) + eps).

    x [..., D] (bf16 / fp16 / fp32; the last dim contiguous, other strides free), rms_weight
    [D] fp32 (= 1 + w) -> y [..., D] contiguous, x's dtype. Normalised and weighted in fp32,
    cast once (transformers' `Qwen3_5RMSNorm.forward`).
    """
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * rms_weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, rms_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a pre-norm: s = residual + x (rounded to x's dtype), then
    y = rms_norm(s). Returns (y, s), both [T, D] contiguous in x's dtype.

    x, residual [T, D] same dtype; rms_weight [D] fp32 (= 1 + w). The norm reads the rounded
    sum, as the unfused `x = x + h; norm(x)` does, so s is bitwise the unfused sum.
    """
    s = residual + x
    return rms_norm(s, rms_weight, eps), s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, gated_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The GDN output norm per value head: y = (w · x̂) · silu(z).

    x [T, HV, V] (the recurrence output), z [T, HV, V] (a view into the merged input
    projection: rows may be strided, the last two dims contiguous), gated_weight [V] in x's
    dtype -> y [T, HV·V] contiguous, x's dtype. Rounding as transformers'
    `Qwen3_5RMSNormGated`: x̂ in fp32 cast to x's dtype, times w in x's dtype, times silu(z)
    in fp32, cast at the end.
    """
    t = x.shape[0]
    dtype = x.dtype
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = gated_weight * y
    return (y * F.silu(z.float())).to(dtype).reshape(t, -1)


def qk_norm_rope(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated attention's query/key prologue: split the query from its gate, RMSNorm q and k
    over the head dim (zero-centred weights), then partial RoPE (rotate-half) on the leading
    `rot` channels of each head.

    q_gate [T, Hq, 2D] (per head [query (D) | gate (D)]; a view into the merged projection,
    rows strided, last two dims contiguous), k [T, Hkv, D] (same kind of view), q_weight /
    k_weight [D] fp32 (= 1 + w), cos / sin [T, rot] in the activation dtype (RotaryEmbedding)
    -> (q [T, Hq, D], k [T, Hkv, D]) contiguous, the activation dtype. The gate is not
    touched: `sigmoid_gate_mul` reads it in place. Reference rounding: norm cast to the
    activation dtype, then RoPE in that dtype (transformers' `apply_rotary_pos_emb`).
    """
    d = k.shape[-1]
    q = rms_norm(q_gate[..., :d], q_weight, eps)
    k = rms_norm(k, k_weight, eps)
    return _rope(q, cos, sin), _rope(k, cos, sin)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    rot = cos.shape[-1]
    cos, sin = cos[:, None, :], sin[:, None, :]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    return torch.cat((x_rot * cos + rotated * sin, x_pass), dim=-1)


def sigmoid_gate_mul(o: torch.Tensor, q_gate: torch.Tensor) -> torch.Tensor:
    """Attention output gate: y = o · sigmoid(gate), gate = q_gate[..., D:].

    o [T, Hq, D] (attention output, contiguous), q_gate [T, Hq, 2D] (the view given to
    `qk_norm_rope`) -> y [T, Hq·D] contiguous, o's dtype; sigmoid and product in the
    activation dtype as transformers' `Qwen3_5Attention.forward`.
    """
    t, hq, d = o.shape
    gate = q_gate[..., d:]
    return o.reshape(t, hq * d) * torch.sigmoid(gate.reshape(t, hq * d))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: y = silu(gate) · up for gate_up [T, 2I] = [gate (I) | up (I)]
    (the merged gate|up projection; rows may be strided) -> y [T, I] contiguous, same dtype.
    Both in the activation dtype, as transformers' `Qwen3_5MLP`.
    """
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]
