"""Paged KV fixtures for the attention op tests: a pool with scattered pages, page tables,
lengths, and a dense per-request definition to compare against."""

from __future__ import annotations

import torch
import torch.nn.functional as F

PEAK = 6.0  # q_scale of the kernel tests (see paged_case)


def paged_case(lens: list[int], rows: int, hq: int, hkv: int, d: int, page_size: int,
               dtype: torch.dtype, device: str = "cpu", seed: int = 0, spare_pages: int = 3,
               q_scale: float = 1.0):
    """Random q [N, R, Hq, D] (times q_scale) and caches [P, page_size, Hkv, D] whose pages are
    handed out in a shuffled order (page 0 never: the padding sink); a length of 0 makes a
    padding request (kv_len = R on a zero table row). Returns q, k_cache, v_cache,
    page_table [N, M] int32, kv_lens [N] int32. With q_scale ~6 the softmax of D^-1/2-scaled
    scores is peaked on a few positions anywhere in the context, so outputs stay O(1) at any
    length and a position (or split) left out moves them by O(1), not O(1/length)."""
    gen = torch.Generator().manual_seed(seed)
    lens = [n if n else rows for n in lens]
    need = [-(-n // page_size) for n in lens]
    max_pages = max(need) + 1
    num_pages = sum(need) + spare_pages + 1
    order = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros((len(lens), max_pages), dtype=torch.int32)
    for i, pages in enumerate(need):
        table[i, :pages] = torch.tensor(order[:pages], dtype=torch.int32)
        order = order[pages:]
    shape = (num_pages, page_size, hkv, d)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = (torch.randn((len(lens), rows, hq, d), generator=gen) * q_scale).to(dtype)
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    return tuple(t.to(device) for t in (q, k_cache, v_cache, table, kv_lens))


def dense_attention(q, k_cache, v_cache, page_table, kv_lens, scale) -> torch.Tensor:
    """The definition, request by request: gather positions 0..kv_len-1 through the table, then
    causal SDPA in fp64 with the rows at the last R positions."""
    n, rows, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty(q.shape, dtype=torch.float64)
    for i in range(n):
        length = int(kv_lens[i])
        pos = torch.arange(length)
        pages = page_table[i].long().cpu()[pos // page_size]
        keys = k_cache.cpu()[pages, pos % page_size].double()  # [L, Hkv, D]
        values = v_cache.cpu()[pages, pos % page_size].double()
        keys = keys.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        values = values.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)
        qi = q[i].cpu().double().transpose(0, 1)  # [Hq, R, D]
        mask = pos[None, :] <= (length - rows + torch.arange(rows))[:, None]
        out[i] = F.scaled_dot_product_attention(qi, keys, values, attn_mask=mask,
                                                scale=scale).transpose(0, 1)
    return out
