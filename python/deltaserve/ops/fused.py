"""Fused element-wise and row-norm ops of the decoder layers (the fast path, DESIGN.md).

Each function is the contract of one kernel of the extension (csrc/kernels/fused.cuh); the
`*_ref` function beside it is its pure-torch reference: the CPU path and the oracle the GPU
kernels are tested against. The references keep the rounding points of the unfused model code
they replace (transformers' `Qwen3_5RMSNorm`, `Qwen3_5RMSNormGated`, `apply_rotary_pos_emb`,
`Qwen3_5MLP`), so the CPU fp32 path still matches transformers token for token. A CUDA kernel
keeps fp32 inside a row and rounds at the same points; against these references it differs
only where its fp32 sum order moves a value across a rounding boundary (bf16 / fp16 ulps).

Weights are prepared once at load time (model/prepare.py), never cast per call:
- `rms_weight` [D] fp32 holds 1 + w of a zero-centred RMSNorm (Qwen3.5's x̂ · (1 + w));
- `gated_weight` [V] in the activation dtype holds w of the GDN gated norm (not zero-centred).

Every wrapper raises ValueError on shapes or dtypes outside its contract, on every path. Inputs
the kernels do not cover (CPU tensors, the extension not built, a row longer than the kernels'
limit, a view with more than two strided outer dims) run the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deltaserve.ops import _checks as checks
from deltaserve.ops import _ext
from deltaserve.ops._ext import KERNEL_DTYPES

# Longest row the norm kernels take: 2048 loads a row (csrc/kernels/fused.cuh, norm_max_row),
# of one element each on the element-wise path a misaligned view takes.
_MAX_ROW_LOADS = 2048


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """The extension runs these: all on CUDA, one kernel dtype, non-empty, dense last dims."""
    first = tensors[0]
    return (first.dtype in KERNEL_DTYPES and first.numel() > 0
            and all(t.dtype == first.dtype and t.stride(-1) == 1 for t in tensors)
            and _ext.use_extension(*tensors))


def _row_fits(d: int, *tensors: torch.Tensor) -> bool:
    """A norm row of d elements fits the kernels: on the vector path when every view is
    16-byte aligned with whole-vector strides, else at one element a load."""
    if d <= _MAX_ROW_LOADS:
        return True
    n = 16 // tensors[0].element_size()
    return d <= _MAX_ROW_LOADS * n and d % n == 0 and all(
        t.data_ptr() % 16 == 0 and all(s % n == 0 for s in t.stride()[:-1]) for t in tensors)


def _weight(name: str, w: torch.Tensor, d: int, dtype: torch.dtype) -> None:
    checks.shape(name, w, (d,))
    if w.dtype != dtype:
        raise ValueError(f"{name} must be {dtype} (prepared at load time), got {w.dtype}")


def _same_dtype(name: str, t: torch.Tensor, like: torch.Tensor) -> None:
    if t.dtype != like.dtype:
        raise ValueError(f"{name} must be {like.dtype} (the activation dtype), got {t.dtype}")


def rms_norm(x: torch.Tensor, rms_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Zero-centred RMSNorm: y = x̂ · rms_weight, x̂ = x / sqrt(mean(x², -1) + eps).

    x [..., D] (bf16 / fp16 / fp32; the last dim contiguous, other strides free), rms_weight
    [D] fp32 (= 1 + w) -> y [..., D] contiguous, x's dtype. Normalised and weighted in fp32,
    cast once (transformers' `Qwen3_5RMSNorm.forward`). Raises ValueError on a weight that is
    not fp32 [D] or a non-floating x.
    """
    checks.floating("x", x)
    _weight("rms_weight", rms_weight, x.shape[-1], torch.float32)
    if x.dim() >= 1 and _kernel_ok(x) and _ext.use_extension(rms_weight):
        rows = x.unsqueeze(0) if x.dim() == 1 else x
        if rows.dim() > 3:
            try:
                rows = rows.view(-1, *x.shape[-2:])
            except RuntimeError:  # outer dims that do not merge: three strides or more
                rows = None
        if rows is not None and _row_fits(x.shape[-1], rows):
            return _ext.ops().rms_norm(rows, rms_weight, eps).view(x.shape)
    return rms_norm_ref(x, rms_weight, eps)


def rms_norm_ref(x: torch.Tensor, rms_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Pure-torch rms_norm (any device); same contract."""
    x32 = x.float()
    y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (y * rms_weight).to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, rms_weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add before a pre-norm: s = residual + x (rounded to x's dtype), then
    y = rms_norm(s). Returns (y, s), both [T, D] contiguous in x's dtype.

    x, residual [T, D] same dtype (rows may be strided); rms_weight [D] fp32 (= 1 + w). The
    norm reads the rounded sum, as the unfused `x = x + h; norm(x)` does, so s is bitwise the
    unfused sum. Raises ValueError on mismatched shapes or dtypes.
    """
    checks.floating("x", x)
    if residual.shape != x.shape:
        raise ValueError(f"residual must have x's shape {list(x.shape)}, "
                         f"got {list(residual.shape)}")
    _same_dtype("residual", residual, x)
    _weight("rms_weight", rms_weight, x.shape[-1], torch.float32)
    if (x.dim() == 2 and _kernel_ok(x, residual) and _ext.use_extension(rms_weight)
            and _row_fits(x.shape[-1], x, residual)):
        return _ext.ops().add_rms_norm(x, residual, rms_weight, eps)
    return add_rms_norm_ref(x, residual, rms_weight, eps)


def add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, rms_weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch add_rms_norm (any device); same contract."""
    s = residual + x
    return rms_norm_ref(s, rms_weight, eps), s


def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, gated_weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The GDN output norm per value head: y = (w · x̂) · silu(z).

    x [T, HV, V] (the recurrence output), z [T, HV, V] (a view into the merged input
    projection: rows may be strided, the last two dims contiguous), gated_weight [V] in x's
    dtype -> y [T, HV·V] contiguous, x's dtype. Rounding as transformers'
    `Qwen3_5RMSNormGated`: x̂ in fp32 cast to x's dtype, times w in x's dtype, times silu(z)
    in fp32, cast at the end. Raises ValueError on mismatched shapes or dtypes.
    """
    checks.floating("x", x)
    if x.dim() != 3:
        raise ValueError(f"x must be [T, HV, V], got shape {list(x.shape)}")
    if z.shape != x.shape:
        raise ValueError(f"z must have x's shape {list(x.shape)}, got {list(z.shape)}")
    _same_dtype("z", z, x)
    _weight("gated_weight", gated_weight, x.shape[-1], x.dtype)
    if _kernel_ok(x, z, gated_weight) and _row_fits(x.shape[-1], x, z, gated_weight):
        return _ext.ops().gated_rms_norm(x, z, gated_weight, eps)
    return gated_rms_norm_ref(x, z, gated_weight, eps)


def gated_rms_norm_ref(x: torch.Tensor, z: torch.Tensor, gated_weight: torch.Tensor,
                       eps: float) -> torch.Tensor:
    """Pure-torch gated_rms_norm (any device); same contract."""
    t = x.shape[0]
    dtype = x.dtype
    x32 = x.float()
    y = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    y = gated_weight * y
    return (y * F.silu(z.float())).to(dtype).reshape(t, -1)


def _check_qk(q_gate, k, q_weight, k_weight, cos, sin) -> None:
    checks.floating("q_gate", q_gate)
    if q_gate.dim() != 3 or k.dim() != 3 or q_gate.shape[0] != k.shape[0] \
            or q_gate.shape[2] != 2 * k.shape[2]:
        raise ValueError("q_gate must be [T, Hq, 2D] and k [T, Hkv, D], got "
                         f"{list(q_gate.shape)} and {list(k.shape)}")
    t, d = k.shape[0], k.shape[2]
    _same_dtype("k", k, q_gate)
    _weight("q_weight", q_weight, d, torch.float32)
    _weight("k_weight", k_weight, d, torch.float32)
    checks.shape("cos", cos, (t, None))
    checks.shape("sin", sin, (t, cos.shape[1]))
    _same_dtype("cos", cos, q_gate)
    _same_dtype("sin", sin, q_gate)
    if cos.shape[1] % 2 or cos.shape[1] > d:
        raise ValueError(f"rot = cos.shape[1] must be even and at most D = {d}, "
                         f"got {cos.shape[1]}")


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
    activation dtype, then RoPE in that dtype (transformers' `apply_rotary_pos_emb`). Raises
    ValueError on mismatched shapes or dtypes, or rot odd or over D.
    """
    _check_qk(q_gate, k, q_weight, k_weight, cos, sin)
    if (_kernel_ok(q_gate, k, cos, sin) and _ext.use_extension(q_weight, k_weight)
            and cos.shape[1] <= 256 and cos.stride(0) == sin.stride(0)
            and _row_fits(k.shape[-1], q_gate, k)):
        return _ext.ops().qk_norm_rope(q_gate, k, q_weight, k_weight, cos, sin, eps)
    return qk_norm_rope_ref(q_gate, k, q_weight, k_weight, cos, sin, eps)


def qk_norm_rope_ref(q_gate: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                     k_weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch qk_norm_rope (any device); same contract."""
    d = k.shape[-1]
    q = rms_norm_ref(q_gate[..., :d], q_weight, eps)
    k = rms_norm_ref(k, k_weight, eps)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim], cos/sin [T, rotary_dim] -> x with its first rotary_dim channels
    rotated (rotate_half convention), the rest passed through; in x's dtype, rounding after
    each op. transformers' `apply_rotary_pos_emb`."""
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
    activation dtype as transformers' `Qwen3_5Attention.forward`. Raises ValueError on
    mismatched shapes or dtypes.
    """
    checks.floating("o", o)
    if o.dim() != 3 or q_gate.dim() != 3 or q_gate.shape[:2] != o.shape[:2] \
            or q_gate.shape[2] != 2 * o.shape[2]:
        raise ValueError("o must be [T, Hq, D] and q_gate [T, Hq, 2D], got "
                         f"{list(o.shape)} and {list(q_gate.shape)}")
    _same_dtype("q_gate", q_gate, o)
    if _kernel_ok(o, q_gate):
        return _ext.ops().sigmoid_gate_mul(o, q_gate)
    return sigmoid_gate_mul_ref(o, q_gate)


def sigmoid_gate_mul_ref(o: torch.Tensor, q_gate: torch.Tensor) -> torch.Tensor:
    """Pure-torch sigmoid_gate_mul (any device); same contract."""
    t, hq, d = o.shape
    gate = q_gate[..., d:]
    return o.reshape(t, hq * d) * torch.sigmoid(gate.reshape(t, hq * d))


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation: y = silu(gate) · up for gate_up [T, 2I] = [gate (I) | up (I)]
    (the merged gate|up projection; rows may be strided) -> y [T, I] contiguous, same dtype.
    Both in the activation dtype, as transformers' `Qwen3_5MLP`. Raises ValueError on an odd
    last dim.
    """
    checks.floating("gate_up", gate_up)
    if gate_up.dim() < 1 or gate_up.shape[-1] % 2:
        raise ValueError(f"gate_up must be [T, 2I], got shape {list(gate_up.shape)}")
    if gate_up.dim() == 2 and _kernel_ok(gate_up):
        return _ext.ops().silu_mul(gate_up)
    return silu_mul_ref(gate_up)


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """Pure-torch silu_mul (any device); same contract."""
    i = gate_up.shape[-1] // 2
    return F.silu(gate_up[..., :i]) * gate_up[..., i:]
