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
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The gated delta rule over whole sequences, with transformers' calling convention.

    query, key [B, T, H, K]; value [B, T, HV, V] (HV a multiple of H: each q/k head serves
    HV / H consecutive value heads); g [B, T, HV] log decay (<= 0); beta [B, T, HV];
    initial_state [B, HV, K, V] or None (zeros). Computes in fp32; q is scaled by K^-1/2 (after
    the optional L2 norm of q and k, eps 1e-6). Returns (output [B, T, HV, V] in query's dtype,
    final state [B, HV, K, V] fp32 or None). Matches transformers' torch_chunk_gated_delta_rule
    (the test oracle) to fp32 rounding; differentiable.
    """
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
    uw = torch.linalg.solve_triangular(eye + a, rhs, upper=False, unitriangular=True)
    u, w = uw.split([dv, dk], dim=-1)
    qk = (q @ k.transpose(-1, -2)) * decay  # [B, HV, N, C, C], zero above the diagonal
    q_decayed = q * c.exp().unsqueeze(-1)
    k_to_end = k * (c[..., -1:] - c).exp().unsqueeze(-1)
    chunk_decay = c[..., -1].exp()  # [B, HV, N]

    state = (initial_state.float() if initial_state is not None
             else q.new_zeros(bsz, n_v_heads, dk, dv))
    outs = []
    for n in range(n_chunks):
        d = u[:, :, n] - w[:, :, n] @ state
        outs.append(q_decayed[:, :, n] @ state + qk[:, :, n] @ d)
        state = chunk_decay[:, :, n, None, None] * state + k_to_end[:, :, n].transpose(-1, -2) @ d
    out = torch.stack(outs, dim=2).reshape(bsz, n_v_heads, -1, dv)[:, :, :seq]
    return out.transpose(1, 2).contiguous().to(out_dtype), (state if output_final_state else None)
