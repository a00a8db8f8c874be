"""The MTP proposer's step as one CUDA graph per batch bucket: catch-up, then k-1 draft steps.

One replay per verify step does what the eager proposer does in k forwards with host work
between them (spec/mtp/proposer.py):
  1. catch-up: the head over the positions [mtp_len, device_len) of each request, whose next
     tokens are now committed: 1..k+1 rows (the rows a verify committed, or the one row a
     prefill or decode left). Every request gets k+1 rows, left-aligned: rows past its count
     are padding at positions device_len .. mtp_len + k, inside the pages the scheduler
     reserved for this verify step (their draft KV is speculative, as the draft steps' is, and
     the next catch-up rewrites it before anything reads it as exact);
  2. the argmax of the head's output at position device_len - 1 is draft 1;
  3. draft j = 2..k: the head at position device_len + j - 2 over (draft j-1, the head's own
     previous output), argmax in the graph.
The drafts land in a static int64 buffer [B, k] that the verify step reads on the device.

Inputs are static buffers refilled before each replay through pinned staging (engine/staging.py):
one int64 copy (row token ids, the hidden-state gather index, mtp_len and the row count per
request) and the page table (PagedMetadata.fill). The target hidden states of the catch-up rows
are gathered on the device (one index_select) from the forward that produced them. Per-step
lengths and positions are computed in the graph from mtp_len and the counts, so one graph
serves every context length up to `max_kv_len`. Padding requests have mtp_len 0, one row and a
zero page-table row: everything they write goes to the padding page 0.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from deltaserve.core import ForwardContext
from deltaserve.engine.attention import PagedAttentionBackend, PagedKVCache, PagedMetadata
from deltaserve.engine.cuda_graph import buckets, capture
from deltaserve.engine.staging import copy_into


@dataclass
class _Graph:
    replay: Callable[[], object]  # the graph's replay (or, uncaptured, the eager step)
    ints: torch.Tensor  # int64 [2*B*R + 2*B]: ids, gather index, mtp_len, counts
    hidden: torch.Tensor  # [B * R, hidden]: target hidden of each catch-up row
    cover: PagedMetadata  # stages the page table [B, max_pages] (its lengths are unused)
    drafts: torch.Tensor  # int64 [B, k]: the output


class MTPGraphs:
    """Fixed-shape MTP steps (see module doc) for batches of up to `max_reqs` requests.

    head(ids [T], hidden [T, H], ctx) -> [T, H] is the MTP head; logits(h [T, H]) -> [T, V] the
    shared LM head. num_steps = k >= 1. max_kv_len: the longest request (positions) a step may
    serve. With `capture=False` the same fixed-shape step runs eagerly (the CPU tests).
    """

    def __init__(self, head: Callable, logits: Callable, kv: PagedKVCache, hidden_size: int,
                 dtype: torch.dtype, device: torch.device, num_steps: int, max_reqs: int,
                 max_kv_len: int, capture: bool = True) -> None:
        if num_steps < 1:
            raise ValueError("MTP graphs need k >= 1 drafts")
        self.head, self.logits, self.kv = head, logits, kv
        self.hidden_size, self.dtype, self.device = hidden_size, dtype, device
        self.k = num_steps
        self.batch_buckets = [x for x in buckets(max_reqs, 1) if x < max_reqs] + [max_reqs]
        # positions a step touches: up to device_len + k (the catch-up's last padding row)
        self.max_kv_len = max_kv_len + 2 * (num_steps + 1)
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.graphs: dict[int, _Graph] = {}
        self.steps = 0  # proposals made by a replay (the tests and benchmarks read it)

    def bucket(self, num_reqs: int, longest: int) -> int | None:
        """The batch bucket for `num_reqs` requests whose longest has device_len `longest`, or
        None (too many requests or positions: the proposer runs eagerly)."""
        if longest + self.k + 1 > self.max_kv_len:
            return None
        return next((x for x in self.batch_buckets if x >= num_reqs), None)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every batch bucket's step now (see GraphRunner.capture_all); returns the
        number captured."""
        new = [b for b in self.batch_buckets if b not in self.graphs]
        for b in new:
            self.graphs[b] = self._capture(b)
        return len(new)

    @torch.inference_mode()
    def run(self, b: int, ids: np.ndarray, gather: np.ndarray, mtp_lens: list[int],
            counts: list[int], page_tables: list[list[int]], src: torch.Tensor) -> torch.Tensor:
        """Replay bucket b for len(mtp_lens) = n <= b requests; returns drafts int64 [n, k] on
        the device, valid until the next `run`.

        ids int64 [b*(k+1)]: row r of request i feeds the token at position mtp_len_i + r + 1
        (padding rows: anything); gather int64 [b*(k+1)]: the row of `src` [*, H] holding the
        target hidden state at position mtp_len_i + r; counts[i] in 1..k+1 real rows.
        """
        ends = [m + c + self.k - 1 for m, c in zip(mtp_lens, counts)]
        return self._replay(b, ids, gather, mtp_lens, counts, ends, page_tables, src)

    @torch.inference_mode()
    def run_chained(self, b: int, mtp_lens: list[int], counts: torch.Tensor,
                    greedy: torch.Tensor, page_tables: list[list[int]],
                    src: torch.Tensor) -> torch.Tensor:
        """`run` where each request's catch-up rows are the rows the previous verify step of
        these requests (same order) committed, not yet seen by the host (engine/
        overlap_verify.py): that step ran request i's k+1 rows from position mtp_lens[i],
        committed counts[i] of them (int64 [n] on the device), read the hidden states
        src[i*(k+1) + r] and gave greedy[i, r] (int64 [n, k+1]), the token after row r. The
        pages must cover mtp_len + 2k + 1 positions (every draft accepted)."""
        n, r = len(mtp_lens), self.k + 1
        gather = np.zeros(b * r, dtype=np.int64)
        gather[:n * r] = np.arange(n * r)
        ends = [m + r + self.k - 1 for m in mtp_lens]
        return self._replay(b, None, gather, mtp_lens, [r] * n, ends, page_tables, src,
                            device_rows=(greedy, counts))

    def _replay(self, b: int, ids: np.ndarray | None, gather: np.ndarray, mtp_lens: list[int],
                counts: list[int], ends: list[int], page_tables: list[list[int]],
                src: torch.Tensor,
                device_rows: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        g = self.graphs.get(b) or self._capture(b)
        self.graphs[b] = g
        n, r = len(mtp_lens), self.k + 1
        ints = np.zeros(g.ints.shape[0], dtype=np.int64)
        if ids is not None:
            ints[:b * r] = ids
        ints[b * r:2 * b * r] = gather
        ints[2 * b * r:2 * b * r + n] = mtp_lens
        ints[2 * b * r + b:] = 1  # padding requests: one row
        ints[2 * b * r + b:2 * b * r + b + n] = counts
        copy_into(g.ints, ints)
        if device_rows is not None:  # in stream order after the staged copy
            greedy, dev_counts = device_rows
            g.ints[:n * r].copy_(greedy.reshape(-1))
            g.ints[2 * b * r + b:2 * b * r + b + n].copy_(dev_counts)
        # the page table, columns up to the last position any row of a request touches
        g.cover.fill(page_tables, ends, self.kv.page_size, lengths=False)  # in-graph lengths
        torch.index_select(src, 0, g.ints[b * r:2 * b * r], out=g.hidden)
        g.replay()
        self.steps += 1
        return g.drafts[:n]

    def _capture(self, b: int) -> _Graph:
        k, r, dev = self.k, self.k + 1, self.device
        ints = torch.zeros(2 * b * r + 2 * b, dtype=torch.long, device=dev)
        ids, starts, counts = ints[:b * r], ints[2 * b * r:2 * b * r + b], ints[2 * b * r + b:]
        counts.fill_(1)
        hidden = torch.zeros(b * r, self.hidden_size, dtype=self.dtype, device=dev)
        table = PagedMetadata.allocate(b, 1, self.max_kv_len, self.kv.page_size, dev).page_table
        cover = PagedMetadata(table, torch.ones(b, dtype=torch.int32, device=dev), 1,
                              self.max_kv_len)
        catch = PagedMetadata(table, torch.full((b,), r, dtype=torch.int32, device=dev), r,
                              self.max_kv_len)
        step_meta = PagedMetadata(table, torch.ones(b, dtype=torch.int32, device=dev), 1,
                                  self.max_kv_len)
        drafts = torch.zeros(b, k, dtype=torch.long, device=dev)
        offsets = torch.arange(r, dtype=torch.long, device=dev)
        first_row = torch.arange(0, b * r, r, dtype=torch.long, device=dev)

        def step() -> None:
            catch.kv_lens.copy_(starts + r)
            ctx = ForwardContext(positions=(starts[:, None] + offsets).reshape(-1),
                                 attn=PagedAttentionBackend(self.kv, catch), gdn=None)
            h = self.head(ids, hidden, ctx).index_select(0, first_row + counts - 1)
            tok = self.logits(h).argmax(dim=-1)
            drafts[:, 0].copy_(tok)
            length = starts + counts  # device_len
            for j in range(1, k):
                step_meta.kv_lens.copy_(length + j)
                ctx = ForwardContext(positions=length + (j - 1),
                                     attn=PagedAttentionBackend(self.kv, step_meta), gdn=None)
                h = self.head(tok, h, ctx)
                tok = self.logits(h).argmax(dim=-1)
                drafts[:, j].copy_(tok)

        if not self.capture:
            return _Graph(step, ints, hidden, cover, drafts)
        graph, _ = capture(step, self.pool)
        return _Graph(graph.replay, ints, hidden, cover, drafts)
