"""Prefill attention: the chunk's new rows are written into their KV pages, then attend causally
over each request's cached positions plus themselves (a row at position p sees positions <= p).

Indices are built once per forward on the host with numpy and uploaded in one copy
(`AttentionMetadata.build`); no layer builds a mask on the host. Two ways to attend:
- **one request at a time** (CUDA, up to PER_REQUEST_MAX requests, or more when the padded
  block would hold over PADDED_MAX row-position pairs: one long chunk among short ones, whose
  padded mask and gathers would be N times its size): a request with no cached
  positions attends over its new rows directly (`is_causal`), one that has some gathers its
  positions from the pages and attends with a bottom-right aligned causal mask
  (`causal_lower_right`); both reach SDPA's fused kernels (flash attention) without a
  materialised mask, so an 8,192-token chunk is ~O(T^2/2 * D) math and O(T * D) bytes;
- **varlen** (CUDA past PER_REQUEST_MAX requests with 16-bit KV, where a Python loop per
  request would launch too much): every request's positions gathered once into one packed
  [sum L, Hkv, D] and one call of FlashAttention-2's variable-length forward (torch's
  `_flash_attention_forward` with cumulative lengths; its causal mask is bottom-right aligned
  per sequence, as `causal_lower_right`): no padding, no mask, kv heads grouped. Before it
  (and where flash cannot run) this was the padded path, whose gathers and mask grow with
  N x the longest request: 8 follow-up turns of 8k cached positions gathered 8 x 8k x 8 heads
  per layer and read a 20 MB mask;
- **padded** (CPU, and CUDA past PER_REQUEST_MAX requests where varlen cannot run): every
  request's positions gathered into [N, L, Hkv, D], its rows into [N, Rmax, Hq, D], one SDPA
  with a boolean mask built on the device. The CPU reference runs this path with the same
  mask and gather as before, so its bits are unchanged.
Scale D^-1/2 (SDPA's default, the model's `scaling`).

SDPA runs with cuDNN's backend left out (`SDPA_BACKENDS`): on sm90+ torch 2.11 tries cuDNN
first, and cuDNN builds an execution plan for every shape it has not seen, while every new
prompt length (and every MTP catch-up of a new row count) is a new shape. Flash and
memory-efficient attention have no per-shape set-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
PER_REQUEST_MAX = 4
PADDED_MAX = 1 << 24  # N * max rows * max positions of the padded path (its mask's elements)
VARLEN_DTYPES = (torch.float16, torch.bfloat16)  # FlashAttention's
logger = logging.getLogger(__name__)
_varlen_failed: list[str] = []  # why the varlen call failed once in this process (then: never)


def varlen_available(device: torch.device) -> bool:
    """Whether the varlen path may run on `device`: CUDA with torch's flash attention, and no
    earlier call in this process failed (module docstring)."""
    return (device.type == "cuda" and not _varlen_failed
            and torch.backends.cuda.is_flash_attention_available())


@dataclass
class AttentionMetadata:
    """A prefill forward's attention indices, shared by every attention layer.

    write_index [T] int64: flat KV index (page * page_size + offset) of each new row.
    spans: per request (first row in the batch, rows, start): its rows sit at positions
        start .. start + rows - 1.
    contexts: per request the flat KV indices [start + rows] of its positions 0.. (a view of
        one uploaded array), or None where start == 0 on the per-request path (its new rows
        are its whole context).
    per_request: True on the per-request path. varlen: True on the varlen path, whose
    tensors are then set: kv_index [sum L] int64 (request i's positions 0.. at kv_bounds[i] ..
    kv_bounds[i + 1]), cu_q / cu_k [N + 1] int32 (cumulative rows / positions), max_q / max_k
    (host ints). Else the padded path's: gather_index [N, L] (padding -> 0), row_index
    [N, Rmax] (padding -> T, a dummy row), mask [N, 1, Rmax, L] bool (row r of request i sees
    positions <= start_i + r).
    """

    write_index: torch.Tensor
    spans: list[tuple[int, int, int]]
    contexts: list[torch.Tensor | None] = field(default_factory=list)
    per_request: bool = True
    gather_index: torch.Tensor | None = None
    row_index: torch.Tensor | None = None
    mask: torch.Tensor | None = None
    varlen: bool = False
    kv_index: torch.Tensor | None = None
    kv_bounds: tuple[int, ...] = ()
    cu_q: torch.Tensor | None = None
    cu_k: torch.Tensor | None = None
    max_q: int = 0
    max_k: int = 0

    @classmethod
    def build(cls, page_tables: list[list[int]], starts: list[int], lens: list[int],
              page_size: int, device: torch.device,
              upload: Callable[[np.ndarray], torch.Tensor] | None = None,
              per_request: bool | None = None, dtype: torch.dtype | None = None,
              varlen: bool | None = None) -> AttentionMetadata:
        """page_tables[i] covers positions [0, starts[i] + lens[i]) of request i (lens >= 1).
        upload(int64 array) -> device tensor: one copy (default: `.to(device)`).
        dtype: the KV cache's (None: unknown, no varlen path). per_request, varlen: the path
        (None: on CUDA per request up to PER_REQUEST_MAX requests, past it varlen where
        `varlen_available` and dtype is 16-bit, else per request past PADDED_MAX; padded
        otherwise and on the CPU). A forced varlen path runs anywhere: where flash cannot,
        its packed gather is attended one request at a time (the same math)."""
        n, device = len(starts), torch.device(device)
        max_rows, max_kv = max(lens), max(s + r for s, r in zip(starts, lens))
        if varlen is None:
            varlen = (per_request is not True and n > PER_REQUEST_MAX
                      and dtype in VARLEN_DTYPES and varlen_available(device))
        if varlen:
            per_request = False
        elif per_request is None:
            per_request = device.type == "cuda" and (
                n <= PER_REQUEST_MAX or n * max_rows * max_kv > PADDED_MAX)
        flats, spans, row = [], [], 0
        for table, start, rows in zip(page_tables, starts, lens):
            kv_len = start + rows
            pages = np.asarray(table[:-(-kv_len // page_size)], dtype=np.int64)
            flats.append((pages[:, None] * page_size
                          + np.arange(page_size, dtype=np.int64)).reshape(-1)[:kv_len])
            spans.append((row, rows, start))
            row += rows
        parts = [np.concatenate([f[s:] for f, (_, _, s) in zip(flats, spans)])]
        if varlen:
            kv_bounds = np.concatenate([[0], np.cumsum([len(f) for f in flats])])
            parts += [np.concatenate(flats), np.concatenate([[0], np.cumsum(lens)]), kv_bounds]
        elif per_request:
            parts += [f for f, (_, _, s) in zip(flats, spans) if s > 0]
        else:
            gather = np.zeros((n, max_kv), dtype=np.int64)
            row_index = np.full((n, max_rows), row, dtype=np.int64)
            for i, (f, (r0, rows, _)) in enumerate(zip(flats, spans)):
                gather[i, :len(f)] = f
                row_index[i, :rows] = np.arange(r0, r0 + rows)
            parts += [gather.reshape(-1), row_index.reshape(-1),
                      np.asarray(starts, dtype=np.int64)]
        sizes = [len(p) for p in parts]
        flat = np.concatenate(parts)
        dev = upload(flat) if upload is not None else torch.from_numpy(flat).to(device)
        views = list(dev.split(sizes))
        meta = cls(views[0], spans, per_request=per_request)
        if varlen:
            meta.varlen, meta.kv_index = True, views[1]
            meta.cu_q, meta.cu_k = views[2].to(torch.int32), views[3].to(torch.int32)
            meta.kv_bounds = tuple(int(b) for b in kv_bounds)
            meta.max_q, meta.max_k = max_rows, max_kv
            return meta
        if per_request:
            it = iter(views[1:])
            meta.contexts = [next(it) if s > 0 else None for _, _, s in spans]
            return meta
        gather, row_index, start_t = views[1:]
        meta.gather_index = gather.view(n, max_kv)
        meta.row_index = row_index.view(n, max_rows)
        pos = torch.arange(max_kv, device=dev.device)
        q_pos = start_t[:, None] + torch.arange(max_rows, device=dev.device)  # [N, Rmax]
        meta.mask = (pos[None, None, :] <= q_pos[:, :, None])[:, None]
        return meta


def prefill_attention(meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Write the new rows' k/v into one layer's pages, then attend.

    meta: the forward's AttentionMetadata; k_cache, v_cache [P, page_size, Hkv, D] (written);
    q [T, Hq, D], k/v [T, Hkv, D] (RoPE applied) -> o [T, Hq, D] contiguous, q's dtype.
    """
    k_flat = k_cache.view(-1, *k_cache.shape[-2:])
    v_flat = v_cache.view(-1, *v_cache.shape[-2:])
    k_flat[meta.write_index] = k.to(k_flat.dtype)
    v_flat[meta.write_index] = v.to(v_flat.dtype)
    if meta.varlen:
        return _varlen(meta, k_flat, v_flat, q)
    if not meta.per_request:
        return _padded(meta, k_flat, v_flat, q)
    outs = []
    for (r0, rows, _), ctx in zip(meta.spans, meta.contexts):
        if ctx is None:  # no cached positions: the new rows are the whole context
            keys, values = k[r0:r0 + rows].to(q.dtype), v[r0:r0 + rows].to(q.dtype)
        else:
            keys, values = k_flat[ctx].to(q.dtype), v_flat[ctx].to(q.dtype)
        outs.append(_causal(q[r0:r0 + rows], keys, values))
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _causal(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """q [R, Hq, D] at the last R of L positions, keys/values [L, Hkv, D] -> [R, Hq, D].
    On CUDA the kv heads go to SDPA as they are (`enable_gqa`: flash and memory-efficient
    attention read each kv head for its group of q heads, so a follow-up turn's 8k cached
    positions are not first copied out four times over, as a repeat to Hq heads did); on the
    CPU they are repeated to Hq heads (the bits the CPU path always had)."""
    hq, hkv = q.shape[1], keys.shape[1]
    gqa = q.is_cuda and hq != hkv
    if hq != hkv and not gqa:
        keys = keys.repeat_interleave(hq // hkv, dim=1)
        values = values.repeat_interleave(hq // hkv, dim=1)
    qh, kh, vh = (x.transpose(0, 1)[None] for x in (q, keys, values))
    rows, length = q.shape[0], keys.shape[0]
    if rows == length:
        out = _sdpa(qh, kh, vh, is_causal=True, enable_gqa=gqa)
    else:
        out = _sdpa(qh, kh, vh, attn_mask=causal_lower_right(rows, length), enable_gqa=gqa)
    return out[0].transpose(0, 1).contiguous()


def _varlen(meta: AttentionMetadata, k_flat: torch.Tensor, v_flat: torch.Tensor,
            q: torch.Tensor) -> torch.Tensor:
    """Every request's positions in one packed gather, then FlashAttention-2's varlen forward
    (module docstring); where flash cannot run (CPU, fp32, a head dim it lacks, or a failed
    call), the same gather one request at a time."""
    keys, values = k_flat[meta.kv_index], v_flat[meta.kv_index]  # [sum L, Hkv, D]
    d = q.shape[-1]
    if (q.is_cuda and not _varlen_failed and q.dtype in VARLEN_DTYPES and keys.dtype == q.dtype
            and d % 8 == 0 and d <= 256):
        try:
            return torch.ops.aten._flash_attention_forward(
                q.contiguous(), keys, values, meta.cu_q, meta.cu_k, meta.max_q, meta.max_k,
                0.0, True, False, scale=d ** -0.5)[0]
        except (RuntimeError, NotImplementedError) as e:  # a build without it: never again
            _varlen_failed.append(str(e))
            logger.warning("varlen prefill attention off, attending one request at a time: "
                           "%s", e)
    b, dt = meta.kv_bounds, q.dtype
    return torch.cat([_causal(q[r0:r0 + rows], keys[b[i]:b[i + 1]].to(dt),
                              values[b[i]:b[i + 1]].to(dt))
                      for i, (r0, rows, _) in enumerate(meta.spans)])


def _padded(meta: AttentionMetadata, k_flat: torch.Tensor, v_flat: torch.Tensor,
            q: torch.Tensor) -> torch.Tensor:
    num_rows, hq, d = q.shape
    hkv = k_flat.shape[1]
    q_pad = torch.cat([q, q.new_zeros(1, hq, d)])[meta.row_index]  # [N, R, Hq, D]
    keys = k_flat[meta.gather_index]  # [N, L, Hkv, D]
    values = v_flat[meta.gather_index]
    if hq != hkv:
        keys = keys.repeat_interleave(hq // hkv, dim=2)
        values = values.repeat_interleave(hq // hkv, dim=2)
    out = _sdpa(
        q_pad.transpose(1, 2), keys.transpose(1, 2).to(q.dtype),
        values.transpose(1, 2).to(q.dtype), attn_mask=meta.mask)  # [N, Hq, R, D]
    flat = q.new_empty(num_rows + 1, hq, d)
    flat[meta.row_index] = out.transpose(1, 2)
    return flat[:num_rows]


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw) -> torch.Tensor:
    """F.scaled_dot_product_attention among SDPA_BACKENDS (module docstring: why)."""
    with sdpa_kernel(SDPA_BACKENDS):
        return F.scaled_dot_product_attention(q, k, v, **kw)
