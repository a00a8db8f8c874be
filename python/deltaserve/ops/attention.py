"""Paged attention for decode and verify rows, and the KV append of those rows.

KV is one layer of the page pool: k_cache / v_cache [P, page_size, Hkv, D]. Request n's
position t lives at page page_table[n, t // page_size], offset t % page_size. kv_lens[n] counts
its positions after this step's R rows are appended: row r sits at position
kv_lens[n] - R + r and attends positions 0 .. kv_lens[n] - R + r (causal among the rows;
decode is R = 1). Query head h reads kv head h // (Hq / Hkv) (GQA). Per row and head:
    o = softmax(scale * q K^T) V,
scores, softmax and the weighted sum in fp32, the output cast to q's dtype. Source: the
attention of Vaswani et al. (2017) as transformers' `sdpa_attention_forward` computes it for
Qwen3.5 / Qwen3-Next (grouped heads, causal mask), over pages as in vLLM's PagedAttention
(Kwon et al., SOSP 2023). The CUDA kernel (csrc/kernels/attention.cuh) splits each request's
positions (flash-decoding) and merges the splits; its two products run on tensor cores, with the
probabilities rounded to q's dtype for the weighted sum (as FlashAttention-2; the row sums add
the rounded values). The references below are the CPU path and the oracle.

Page tables and lengths are device tensors: the kernels read them there, so one CUDA graph per
batch size serves every context length up to `max_kv_len`.
"""

from __future__ import annotations

import torch

from deltaserve.ops import _checks as checks
from deltaserve.ops import _ext
from deltaserve.ops._ext import vector_rows

KERNEL_KV_DTYPES = (torch.bfloat16, torch.float16)
KERNEL_ATTN_HEAD_DIMS = (64, 128, 256)
KERNEL_MAX_ROWS = 16  # rows per request the kernel takes (R)


def _check_pages(k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                 kv_lens: torch.Tensor, n: int, rows: int, head_dim: int) -> None:
    """Cache, page table and length shapes; on CPU also their values (no sync elsewhere)."""
    checks.floating("k_cache", k_cache)
    if k_cache.dim() != 4 or k_cache.shape[-1] != head_dim:
        raise ValueError(f"k_cache must be [P, page_size, Hkv, D={head_dim}], got "
                         f"{list(k_cache.shape)}")
    checks.shape("v_cache", v_cache, tuple(k_cache.shape))
    if page_table.dtype != torch.int32 or kv_lens.dtype != torch.int32:
        raise ValueError(f"page_table and kv_lens must be int32, got {page_table.dtype} and "
                         f"{kv_lens.dtype}")
    checks.shape("page_table", page_table, (n, None))
    checks.shape("kv_lens", kv_lens, (n,))
    if page_table.shape[1] == 0:
        raise ValueError("page_table must have at least one column")
    checks.in_range("page_table", page_table, 0, k_cache.shape[0])
    checks.in_range("kv_lens", kv_lens, rows, page_table.shape[1] * k_cache.shape[1] + 1)


def _kernel_ok(*tensors: torch.Tensor) -> bool:
    """The extension handles tensors of this dtype (else the reference runs, also on CUDA)."""
    return (_ext.use_extension(*tensors) and tensors[0].dtype in KERNEL_KV_DTYPES
            and all(t.dtype == tensors[0].dtype for t in tensors)
            and tensors[0].shape[-1] in KERNEL_ATTN_HEAD_DIMS)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    page_table: torch.Tensor, kv_lens: torch.Tensor, scale: float,
                    max_kv_len: int) -> torch.Tensor:
    """Attention of R rows per request over its pages; returns o [N, R, Hq, D] (q's dtype).

    q [N, R, Hq, D]; k_cache, v_cache [P, page_size, Hkv, D] (q's dtype on the kernel path:
    bf16/fp16, D 64, 128 or 256, R <= 16; anything else runs the reference); page_table [N, M]
    int32 page ids; kv_lens [N] int32 in R .. M * page_size, the rows' own positions included
    (append them first: `kv_append`); scale: the softmax scale (D^-1/2 for Qwen);
    max_kv_len: an upper bound on kv_lens (a host int: it sizes the kernel's split grid and
    workspace; a CUDA graph passes max_model_len). Page 0 rows and zero-filled table rows serve
    padding requests (kv_lens = R). Raises ValueError on shapes or dtypes that do not fit, and
    on CPU on page ids or lengths out of range (on CUDA those are the caller's contract: no
    sync; a length past the table is capped at it, never read past).
    """
    if q.dim() != 4:
        raise ValueError(f"q must be [N, R, Hq, D], got shape {list(q.shape)}")
    checks.floating("q", q)
    n, rows, hq, d = q.shape
    _check_pages(k_cache, v_cache, page_table, kv_lens, n, rows, d)
    if hq % k_cache.shape[2]:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({k_cache.shape[2]})")
    if max_kv_len < 1:
        raise ValueError(f"max_kv_len must be >= 1, got {max_kv_len}")
    if n == 0:
        return q.new_empty(q.shape)
    if _kernel_ok(q, k_cache, v_cache) and rows <= KERNEL_MAX_ROWS and k_cache.is_contiguous():
        return _ext.ops().paged_attention(q.contiguous(), k_cache, v_cache,
                                          page_table.contiguous(), kv_lens.contiguous(),
                                          float(scale), int(max_kv_len))
    return paged_attention_ref(q, k_cache, v_cache, page_table, kv_lens, scale, max_kv_len)


def paged_attention_ref(q, k_cache, v_cache, page_table, kv_lens, scale, max_kv_len):
    """Pure-torch paged_attention (any device; same contract). Gathers max_kv_len positions
    on CUDA (static shapes: no sync, capturable) and max(kv_lens) on CPU."""
    n, rows, hq, d = q.shape
    page_size, hkv = k_cache.shape[1], k_cache.shape[2]
    span = max_kv_len if q.is_cuda else int(kv_lens.max())
    pages = min(-(-span // page_size), page_table.shape[1])
    pos = torch.arange(pages * page_size, device=q.device)
    flat = page_table[:, :pages].long()[:, pos // page_size] * page_size + pos % page_size
    keys = k_cache.reshape(-1, hkv, d)[flat].float()  # [N, L, Hkv, D]
    values = v_cache.reshape(-1, hkv, d)[flat].float()
    qf = q.float().view(n, rows, hkv, hq // hkv, d)
    scores = torch.einsum("nrhgd,nlhd->nhgrl", qf, keys) * scale
    q_pos = kv_lens.long()[:, None] - rows + torch.arange(rows, device=q.device)  # [N, R]
    seen = pos[None, None, :] <= q_pos[:, :, None]  # [N, R, L]
    scores = scores.masked_fill(~seen[:, None, None], float("-inf"))
    out = torch.einsum("nhgrl,nlhd->nrhgd", scores.softmax(-1), values)
    return out.reshape(n, rows, hq, d).to(q.dtype)


def kv_append(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              page_table: torch.Tensor, kv_lens: torch.Tensor) -> None:
    """Write each request's R new rows into their pages: row r of request n (k/v row n*R + r)
    goes to position kv_lens[n] - R + r.

    k, v [N * R, Hkv, D] (cast to the cache's dtype); k_cache, v_cache [P, page_size, Hkv, D],
    written in place; page_table [N, M] int32; kv_lens [N] int32 as for `paged_attention`.
    Padding requests write page 0 (zero table rows). Raises ValueError on shapes or dtypes that
    do not fit (and on CPU on page ids or lengths out of range).
    """
    n = kv_lens.shape[0] if kv_lens.dim() == 1 else -1
    if k.dim() != 3 or n < 0 or (n and k.shape[0] % n):
        raise ValueError(f"k must be [N * R, Hkv, D] for N = kv_lens' length, got "
                         f"{list(k.shape)} and kv_lens {list(kv_lens.shape)}")
    checks.shape("v", v, tuple(k.shape))
    if n == 0:
        return
    rows = k.shape[0] // n
    _check_pages(k_cache, v_cache, page_table, kv_lens, n, rows, k.shape[-1])
    checks.shape("k", k, (None, k_cache.shape[2], k_cache.shape[3]))
    k, v = k.to(k_cache.dtype), v.to(v_cache.dtype)
    if (_kernel_ok(k, v, k_cache, v_cache) and k_cache.is_contiguous()
            and vector_rows(k, 2, 8) and vector_rows(v, 2, 8)):
        _ext.ops().kv_append(k, v, k_cache, v_cache, page_table.contiguous(),
                             kv_lens.contiguous())
        return
    kv_append_ref(k, v, k_cache, v_cache, page_table, kv_lens)


def kv_append_ref(k, v, k_cache, v_cache, page_table, kv_lens) -> None:
    """Pure-torch kv_append (any device; same contract)."""
    n = kv_lens.shape[0]
    rows = k.shape[0] // n
    page_size, hkv, d = k_cache.shape[1:]
    pos = (kv_lens.long()[:, None] - rows + torch.arange(rows, device=k.device)).view(-1)
    req = torch.arange(n, device=k.device).repeat_interleave(rows)
    flat = page_table.long()[req, pos // page_size] * page_size + pos % page_size
    k_cache.view(-1, hkv, d)[flat] = k.to(k_cache.dtype)
    v_cache.view(-1, hkv, d)[flat] = v.to(v_cache.dtype)
