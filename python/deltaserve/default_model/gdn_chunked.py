"""A chunked gated delta rule in plain torch, fast enough to train the default model with.

Why: fla-core 0.6.0 refuses its gated backward kernel on Hopper with Triton < 3.7.1 (fla issue
#640: wrong gradients), which is what the device H200 has; transformers' own torch fallback
inverts each 64 x 64 chunk matrix with a 63-step Python loop. Here the inverse is one
`torch.linalg.solve_triangular` per layer and every chunk's intra-chunk work is batched, so
only the state hand-off between chunks is a loop (T / chunk_size steps). Autograd gives the
backward. Forward only needs ~15 kernels per chunk step.

Math (Yang, Kautz, Hatamizadeh, "Gated Delta Networks", ICLR 2025, the WY / UT form of
section 3): per value head, with state S [K, V],
    S_t = exp(g_t) S_{t-1} + k_t d_t^T,   d_t = beta_t (v_t - exp(g_t) S_{t-1}^T k_t),
    o_t = S_t^T q_t.
In a chunk entered with state S0, with cumulative log decay c_i = g_1 + ... + g_i:
    (I + A) D = beta * V - beta * exp(c) * (K S0),   A_ij = beta_i exp(c_i - c_j) k_i.k_j (j < i)
so D = U - W S0 with U = (I + A)^-1 beta V and W = (I + A)^-1 (beta exp(c) K), and
    O = (exp(c) Q) S0 + [(Q K^T) * exp(c_i - c_j)]_{j <= i} D,
    S_C = exp(c_C) S0 + (exp(c_C - c) K)^T D.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def chunk_gated_delta_rule_torch(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    chunk_size: int = 64,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    solve: str = "trsm",
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences, with transformers' calling convention.

    query, key [B, T, H, K]; value [B, T, HV, V] (HV a multiple of H: each q/k head serves
    HV / H consecutive value heads); g [B, T, HV] log decay (<= 0); beta [B, T, HV];
    initial_state [B, HV, K, V] or None (zeros). Computes in fp32; q is scaled by K^-1/2 (after
    the optional L2 norm of q and k, eps 1e-6). Returns (output [B, T, HV, V] in query's dtype,
    final state [B, HV, K, V] fp32 or None). Matches transformers' torch_chunk_gated_delta_rule
    (the test oracle) to fp32 rounding; differentiable. `solve` picks how (I + A)^-1 is
    applied: "trsm" (torch.linalg.solve_triangular, one batched triangular solve) or "blocked"
    (unit_lower_inverse: matmuls and a 16-step substitution, for GPUs where batched trsm over
    many small matrices is slow). Raises ValueError for another `solve`.
    """
    if solve not in ("trsm", "blocked"):
        raise ValueError(f"solve must be 'trsm' or 'blocked', got {solve!r}")
    out_dtype = query.dtype
    bsz, seq, n_k_heads, dk = key.shape
    n_v_heads, dv = value.shape[-2:]
    if n_v_heads % n_k_heads:
        raise ValueError(f"value heads {n_v_heads} are not a multiple of key heads {n_k_heads}")
    if n_v_heads != n_k_heads:
        query = query.repeat_interleave(n_v_heads // n_k_heads, dim=2)
        key = key.repeat_interleave(n_v_heads // n_k_heads, dim=2)
    q, k, v, b, gl = (x.transpose(1, 2).float() for x in (query, key, value, beta, g))
    if use_qk_l2norm_in_kernel:
        q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    q = q * dk**-0.5
    pad = (-seq) % chunk_size
    if pad:  # zero k, v, beta and g: padded steps leave the state unchanged
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        b, gl = (F.pad(x, (0, pad)) for x in (b, gl))
    n_chunks = (seq + pad) // chunk_size
    q, k, v = (x.reshape(bsz, n_v_heads, n_chunks, chunk_size, -1) for x in (q, k, v))
    b, gl = (x.reshape(bsz, n_v_heads, n_chunks, chunk_size) for x in (b, gl))

    c = gl.cumsum(-1)  # [B, HV, N, C]
    causal = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    # exp(c_i - c_j) on and below the diagonal, 0 above (masked before exp: no overflow)
    decay = (c.unsqueeze(-1) - c.unsqueeze(-2)).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a = (b.unsqueeze(-1) * kk * decay).tril(-1)
    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)
    rhs = torch.cat([b.unsqueeze(-1) * v, (b * c.exp()).unsqueeze(-1) * k], dim=-1)
    if solve == "trsm":
        uw = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    else:
        uw = unit_lower_inverse(a) @ rhs
    u, w = uw.split([dv, dk], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay  # [B, HV, N, C, C], zero above the diagonal
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()  # [B, HV, N]

    state = (initial_state.float() if initial_state is not None
             else q.new_zeros(bsz, n_v_heads, dk, dv))
    outs = []
    # unbind, not u[:, :, n]: each indexing op's backward writes a gradient the size of the
    # whole tensor and autograd sums n_chunks of them; unbind's backward stacks them once
    per_chunk = zip(*(x.unbind(2) for x in (u, w, q_decayed, qk, k_to_end, chunk_decay)))
    for u_n, w_n, q_n, qk_n, k_n, decay_n in per_chunk:
        d = u_n - w_n @ state
        outs.append(q_n @ state + qk_n @ d)
        state = decay_n[..., None, None] * state + k_n.transpose(-1, -2) @ d
    out = torch.stack(outs, dim=2).reshape(bsz, n_v_heads, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).contiguous().to(out_dtype), (state if output_final_state else None)


def unit_lower_inverse(a: torch.Tensor, block: int = 16) -> torch.Tensor:
    """T = (I + a)^-1 for strictly lower triangular `a` [..., C, C] (C a power-of-two multiple
    of `block`, or at most `block`), differentiable.

    Forward substitution inverts the diagonal blocks of size `block` together (`block` - 1
    steps), then pairs of neighbouring inverses merge by the block rule
        [[T1, 0], [A21, T2]]^-1 = [[T1^-1, 0], [-T2^-1 A21 T1^-1, T2^-1]]
    until one block spans C: log2(C / block) levels of two matmuls each. Every product is of
    inverses of unit triangular blocks, so no entry grows the way the powers of `a` in a
    Neumann product would (which a TF32 matmul would then round badly). The backward keeps
    only T: dL/da = -(T^T (dL/dT) T^T) below the diagonal (from dT = -T da T), not the
    substitution's intermediate rows. Raises ValueError for a C it cannot split.
    """
    return _UnitLowerInverse.apply(a, _diagonal_block(a.shape[-1], block))


class _UnitLowerInverse(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, block: int) -> torch.Tensor:
        t = _unit_lower_inverse(a, block)
        ctx.save_for_backward(t)
        return t

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        (t,) = ctx.saved_tensors
        tt = t.transpose(-1, -2)
        return -(tt @ grad @ tt).tril(-1), None


def _diagonal_block(size: int, block: int) -> int:
    """The diagonal blocks' size: `block`, or `size` when smaller; raises ValueError when
    `size` is not a power of two of them."""
    nb = max(1, size // block)
    if nb * (size // nb) != size or nb & (nb - 1):
        raise ValueError(f"{size} x {size} does not split into a power of two of {block}-blocks")
    return size // nb


def _unit_lower_inverse(a: torch.Tensor, block: int) -> torch.Tensor:
    nb = a.shape[-1] // block
    diag = torch.stack([a[..., i * block:(i + 1) * block, i * block:(i + 1) * block]
                        for i in range(nb)], dim=-3)  # [..., nb, block, block]
    eye = torch.eye(block, dtype=a.dtype, device=a.device)
    rows = [eye[0].expand_as(diag[..., 0, :])]
    for i in range(1, block):  # row i of T = e_i - a[i, :i] T[:i]
        prev = torch.stack(rows, dim=-2)  # [..., nb, i, block]
        rows.append(eye[i] - (diag[..., i:i + 1, :i] @ prev).squeeze(-2))
    inv = list(torch.stack(rows, dim=-2).unbind(-3))  # nb inverses [..., block, block]
    while len(inv) > 1:
        w = inv[0].shape[-1]
        merged = []
        for j in range(0, len(inv), 2):
            r0 = (j + 1) * w  # first row of the lower block within `a`
            a21 = a[..., r0:r0 + w, j * w:r0]
            t21 = -(inv[j + 1] @ a21 @ inv[j])
            top = torch.cat([inv[j], torch.zeros_like(inv[j])], dim=-1)
            merged.append(torch.cat([top, torch.cat([t21, inv[j + 1]], dim=-1)], dim=-2))
        inv = merged
    return inv[0]


def causal_conv1d_shift(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                        activation: str | None = None, **_: object) -> torch.Tensor:
    """Depthwise causal convolution as W shifted multiply-adds, in fp32, cast back to x's
    dtype: out[b, c, t] = act(bias[c] + sum_j weight[c, j] x[b, c, t - W + 1 + j]) with x zero
    before t = 0. x [B, C, T], weight [C, W]; activation None, "silu" or "swish".

    The same values as transformers' `F.conv1d` fallback, in elementwise ops that
    torch.compile fuses into one kernel with its backward (cuDNN's depthwise backward is a
    suspect of the training step's time). Raises ValueError for another activation.
    """
    if activation not in (None, "silu", "swish"):
        raise ValueError(f"activation must be None, 'silu' or 'swish', got {activation!r}")
    width, seq = weight.shape[-1], x.shape[-1]
    xp = F.pad(x.float(), (width - 1, 0))
    w = weight.float()
    out = xp[..., :seq] * w[:, :1]
    for j in range(1, width):
        out = out + xp[..., j:j + seq] * w[:, j:j + 1]
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = F.silu(out)
    return out.to(x.dtype)
