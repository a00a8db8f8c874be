"""Pure-torch chunked gated delta rule (chunk 64) over packed sequences, fp32.

The WY/UT form of Yang et al. 2024 (Gated Delta Networks, sec. 3.3), the same math as
transformers' `torch_chunk_gated_delta_rule`, with the state kept per value head as H = S^T
[K, V] inside and returned in deltaserve's [V, K] layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64


def _one_sequence(q, k, v, g, beta, h):
    """q, k [HV, T, K] (q scaled, both normalised), v [HV, T, V], g, beta [HV, T] fp32,
    h [HV, K, V] fp32 -> (o [HV, T, V], final h [HV, K, V])."""
    hv, t, _ = k.shape
    if t == 0:
        return v.new_zeros(hv, 0, v.shape[-1]), h
    pad = (-t) % CHUNK
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    nc = (t + pad) // CHUNK
    q, k, v = (x.reshape(hv, nc, CHUNK, x.shape[-1]) for x in (q, k, v))
    g, beta = g.reshape(hv, nc, CHUNK), beta.reshape(hv, nc, CHUNK)

    cum = g.cumsum(-1)  # log decay from the chunk start through position i
    upper = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    # (I + strict_lower(beta_i k_i.k_j decay_ij)) u = beta v ; same system for the decayed keys.
    system = ((k_beta @ k.transpose(-1, -2)) * decay).tril(-1)
    system = system + torch.eye(CHUNK, dtype=system.dtype, device=system.device)
    u = torch.linalg.solve_triangular(system, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(system, k_beta * cum.exp()[..., None], upper=False,
                                      unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * cum.exp()[..., None]
    k_decayed = k * (cum[..., -1:] - cum).exp()[..., None]
    chunk_decay = cum[..., -1].exp()[..., None, None]

    out = torch.empty_like(v)
    for c in range(nc):
        v_new = u[:, c] - w[:, c] @ h
        out[:, c] = q_decayed[:, c] @ h + attn[:, c] @ v_new
        h = h * chunk_decay[:, c] + k_decayed[:, c].transpose(-1, -2) @ v_new
    return out.reshape(hv, nc * CHUNK, -1)[:, :t], h


def chunk_gated_delta_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, initial_state: torch.Tensor,
                          cu_seqlens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [T, HV, K] fp32 (normalised, q scaled, already repeated to HV heads),
    v [T, HV, V], g, beta [T, HV] fp32, initial_state [N, HV, V, K] fp32,
    cu_seqlens [N+1] -> (o [T, HV, V] in v's dtype, final_state [N, HV, V, K] fp32)."""
    bounds = cu_seqlens.tolist()
    o = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    finals = []
    for i in range(len(bounds) - 1):
        sl = slice(bounds[i], bounds[i + 1])
        h0 = initial_state[i].float().transpose(-1, -2)  # [HV, K, V]
        oi, h = _one_sequence(q[sl].transpose(0, 1), k[sl].transpose(0, 1),
                              v[sl].float().transpose(0, 1), g[sl].t(), beta[sl].t(), h0)
        o[sl] = oi.transpose(0, 1).to(v.dtype)
        finals.append(h.transpose(-1, -2))
    final = torch.stack(finals) if finals else initial_state.float().clone()
    return o, final.contiguous()
