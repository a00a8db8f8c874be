"""CUDA graphs for decode and verify steps.

One graph per padded batch size, and for verify per stash written (two, alternating: see
GDNStatePool's deferred replay), captured on first use into one shared memory pool. A graph
runs the whole step: embeddings, every layer (KV append and paged attention reading the page
tables and lengths from static device buffers, so one graph serves every context length up to
max_model_len; GDN decode or verify against the state pool), the final norm and the logits of
every row. Inputs live in static buffers refilled before each replay; padding requests use the
padding slot 0 and the padding page 0, so they never touch a real request. Outputs (logits,
their per-row argmax, hidden, the verify stash and conv inputs that `commit` reads) stay valid
until the next replay. Drafts a proposer left on the device (`Batch.draft_tensor`, the MTP
graph's output) are copied into a verify graph's input ids on the device, and so are the tokens
of an overlapped decode step (`DeviceTokens`: the previous step's sampled tokens, gathered by a
row index, engine/overlap.py). Inputs are staged in
pinned host memory and copied without blocking (engine/staging.py); the argmax in the graph
lets a greedy step copy only its tokens back, and a verify graph also compares the drafts
with it (the greedy acceptance, `ForwardOutput.accepted`), so a greedy verify step launches
nothing between its replay and the one copy back. A verify graph always takes pending rows
from a static int32 buffer (zeros when none are pending for its batch). MoE models are
captured when their experts run without a host sync at the largest batch
(`model.mlp.moe_graph_safe`).

A decode runner built with `hidden_ring` steps (the plain steps of an MTP engine, whose proposer
keeps each step's hidden states until a later catch-up) has its graph copy the hidden rows into
the next slot of a ring instead of the host cloning them after each replay (an allocation and a
launch on the host's critical path of a step that does not speculate): the step hands out a
view of its slot, valid for `hidden_ring` more replays (the proposer's bound,
`Proposer.hidden_steps_held`); a replay that keeps nothing writes a scratch slot.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from deltaserve.core import Batch, ForwardContext, Phase
from deltaserve.engine.attention import PagedAttentionBackend, PagedMetadata
from deltaserve.engine.gdn_backend import GDNMetadata, PoolGDNBackend
from deltaserve.engine.model_runner import ForwardOutput, ModelRunner
from deltaserve.engine.staging import copy_into, row_positions
from deltaserve.model.mlp import moe_graph_safe
from deltaserve.spec.accept import pack_greedy

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig

logger = logging.getLogger("deltaserve.engine")


def buckets(limit: int, start: int) -> list[int]:
    """Powers of two from `start` up to the first one >= limit."""
    out = [start]
    while out[-1] < limit:
        out.append(out[-1] * 2)
    return out


@dataclass
class DeviceTokens:
    """Inputs of a decode step launched before the previous step's tokens reached the host
    (engine/overlap.py): request i feeds tokens[index[i]] (tokens int64 [M], index int64 [N],
    both on the device; index None: tokens[i], the rows kept their order) at position
    starts[i] (its device_len + ahead, known on the host)."""

    starts: list[int]
    tokens: torch.Tensor
    index: torch.Tensor | None


@dataclass
class VerifyChain:
    """Inputs of a verify step launched before the previous verify step of the same requests,
    in the same order, landed (engine/overlap_verify.py). That step started request i at
    position starts[i] (host) and committed counts[i] rows (int64 [N] on the device: its
    accepted drafts + 1), so this step's rows start at starts[i] + counts[i] and its first row
    feeds greedy[i, counts[i] - 1] (greedy int64 [N, R]: the previous step's argmax rows)."""

    starts: list[int]
    counts: torch.Tensor
    greedy: torch.Tensor


@dataclass
class _Graph:
    replay: Callable[[], object]  # the graph's replay (or, uncaptured, the eager step)
    ints: torch.Tensor  # int64 [2 * B * R + B (+ 1)]: input ids, positions, drafts per request
    # (and, with a hidden-state ring, the first ring row the step writes)
    input_ids: torch.Tensor  # [B * R] int64, a view of ints
    positions: torch.Tensor  # [B * R] int64, a view of ints
    attn: PagedMetadata  # static page table [B, max_pages] and lengths [B]
    gdn: PoolGDNBackend  # holds the static slots [B] and, for verify, the conv inputs
    hidden: torch.Tensor  # [B * R, hidden]
    logits: torch.Tensor  # [B * R, vocab] fp32
    greedy: torch.Tensor  # [B * R] int64: argmax of each logits row, computed in the graph
    accepted: torch.Tensor | None  # verify: [B, R + 1] int64, ForwardOutput.accepted


class GraphRunner:
    """Replays captured graphs for decode/verify batches that fit a bucket.

    With `capture=False` the same fixed-shape step runs eagerly (the CPU tests check the
    padding that way); batch buckets never exceed `max_reqs` (the verify stash's size).
    """

    def __init__(self, runner: ModelRunner, max_reqs: int, rows: int, max_kv_len: int,
                 capture: bool = True, hidden_ring: int = 0) -> None:
        if hidden_ring and rows != 1:
            raise ValueError("a hidden-state ring is for decode steps (rows = 1)")
        self.runner = runner
        self.rows = rows
        self.phase = Phase.VERIFY if rows > 1 else Phase.DECODE
        self.batch_buckets = [x for x in buckets(max_reqs, 1) if x < max_reqs] + [max_reqs]
        # every step attends at most max_kv_len positions (a request's length plus its rows)
        self.max_kv_len = max_kv_len + rows
        # (batch bucket,) for decode; + the index of the stash written, for verify
        self.graphs: dict[tuple[int, ...], _Graph] = {}
        self.capture = capture
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        # steps of this runner's phase run through a graph / declined (run eagerly): the
        # long-context benchmark reports both (no eager step at any length)
        self.graph_steps = 0
        self.eager_steps = 0
        # hidden_ring steps of [max bucket, hidden] rows, then the scratch slot (module doc)
        self.ring_steps, self.ring_next = hidden_ring, 0
        self.ring: torch.Tensor | None = None
        if hidden_ring:
            c, b = runner.model.config, self.batch_buckets[-1]
            self.ring = torch.empty(((hidden_ring + 1) * b, c.hidden_size),
                                    dtype=runner.model.dtype, device=runner.device)

    def bucket(self, batch: Batch, starts: list[int] | None = None) -> tuple[int] | None:
        """The batch bucket of `batch` (its requests' first positions `starts`, default each
        device_len), or None: another phase, or more requests or positions than the graphs
        were sized for (the engine runs it eagerly)."""
        if batch.phase is not self.phase or batch.rows_per_req != self.rows:
            return None
        if starts is None:
            starts = [r.device_len for r in batch.reqs]
        if max(starts) + self.rows > self.max_kv_len:
            return None
        b = next((x for x in self.batch_buckets if x >= batch.size), None)
        return None if b is None else (b,)

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Capture every batch bucket's graph now (both stash parities for verify), as vLLM
        and SGLang do at start-up: a capture on first use stalls the step that meets a new
        bucket (tens of ms to seconds), and did inside bench_spec's timed runs. Returns the
        number of graphs captured."""
        keys = ([(b, w) for b in self.batch_buckets for w in (0, 1)]
                if self.phase is Phase.VERIFY else [(b,) for b in self.batch_buckets])
        new = [key for key in keys if key not in self.graphs]
        for key in new:
            self.graphs[key] = self._capture(*key)
        return len(new)

    @torch.inference_mode()
    def forward(self, batch: Batch, keep_hidden: bool = False,
                device_tokens: DeviceTokens | None = None,
                chain: VerifyChain | None = None) -> ForwardOutput | None:
        """Run `batch` through its bucket's graph; None when no bucket fits (run eagerly).
        With `device_tokens` (a decode batch) the rows' tokens and positions come from there
        instead of the requests' committed tokens and device_len; with `chain` (a verify
        batch with its drafts on the device) the pending token and the positions do."""
        if device_tokens is not None:
            starts = device_tokens.starts
        elif chain is not None:  # the furthest the rows can start: every draft accepted
            starts = [s + self.rows for s in chain.starts]
        else:
            starts = [r.device_len for r in batch.reqs]
        key = self.bucket(batch, starts)
        if key is None:
            self.eager_steps += batch.phase is self.phase
            return None
        self.graph_steps += 1
        n, rows, runner = batch.size, self.rows, self.runner
        slot_ids = [r.slot for r in batch.reqs]
        write, pend = runner.take_pending(self.phase, slot_ids)  # a replay runs no Python
        if self.phase is Phase.VERIFY:  # one graph per stash it writes (they alternate)
            key = (*key, write)
        g = self.graphs.get(key) or self._capture(*key)
        self.graphs[key] = g
        b = g.gdn.meta.slots.shape[0]
        # padding rows feed token 0 at position 0 into slot 0 / page 0 (never a real request)
        ints = np.zeros(g.ints.shape[0], dtype=np.int64)
        ids, pos = ints[:b * rows], ints[b * rows:2 * b * rows]
        if self.phase is Phase.VERIFY:  # padding requests: no drafts, none accepted
            ints[2 * b * rows:2 * b * rows + n] = batch.num_drafts or rows - 1
        on_device = batch.draft_ids is None and batch.draft_tensor is not None
        if chain is not None:  # positions from the previous step's starts, moved below
            assert on_device, "a chained verify step takes its drafts on the device"
            pos[:n * rows] = row_positions(chain.starts, rows)
        else:
            if on_device:  # the pending tokens from here, the drafts below from the device
                ids[:n * rows:rows] = [r.tokens(r.device_len, r.device_len + 1)[0]
                                       for r in batch.reqs]
            elif device_tokens is None:
                ids[:n * rows] = runner.input_ids(batch)
            pos[:n * rows] = row_positions(starts, rows)
        slots = np.zeros(b, dtype=np.int32)
        slots[:n] = slot_ids
        ring_rows = self._ring_rows(ints, n * rows, keep_hidden)
        copy_into(g.ints, ints)
        if on_device:  # in stream order after the staged copy: no host round trip
            g.input_ids.view(b, rows)[:n, 1:].copy_(batch.draft_tensor)
        if device_tokens is not None:  # likewise, and before this replay overwrites them
            if device_tokens.index is None:
                g.input_ids[:n].copy_(device_tokens.tokens[:n])
            else:
                torch.index_select(device_tokens.tokens, 0, device_tokens.index,
                                   out=g.input_ids[:n])
        copy_into(g.gdn.meta.slots, slots)
        if g.gdn.meta.pending is not None:
            rows_buf = g.gdn.meta.pending[1]
            rows_buf.zero_()
            if pend is not None:
                rows_buf[:n].copy_(pend)
        g.attn.fill([r.page_table for r in batch.reqs], starts, runner.kv.page_size)
        if chain is not None:  # in stream order after the staged copies above
            _chain_inputs(g, chain, n, rows)
        out = g.replay()
        if out is not None:  # uncaptured: the eager step returned fresh tensors
            g.hidden, g.logits, g.greedy, g.accepted = out
        runner.last_gdn = g.gdn
        runner.last_slot_ids = slot_ids
        t = n * rows
        hidden = ring_rows if ring_rows is not None \
            else g.hidden[:t].clone() if keep_hidden else None
        accepted = g.accepted[:n] if g.accepted is not None else None
        return ForwardOutput(g.logits[:t], [r for r in batch.reqs for _ in range(rows)], hidden,
                             g.greedy[:t], accepted)

    def _ring_rows(self, ints: np.ndarray, t: int, keep: bool) -> torch.Tensor | None:
        """With a ring: set the staged ring offset (ints' last) to the next slot when the
        step's hidden rows are kept, else to the scratch slot; the kept slot's first t rows
        (a view, filled by the replay), or None."""
        if self.ring is None:
            return None
        width = self.batch_buckets[-1]
        if not keep:
            ints[-1] = self.ring_steps * width
            return None
        start = self.ring_next * width
        self.ring_next = (self.ring_next + 1) % self.ring_steps
        ints[-1] = start
        return self.ring[start:start + t]

    def _capture(self, b: int, write: int = 0) -> _Graph:
        """Capture (or, capture=False, build eagerly) the step of batch bucket b; a verify
        step writes runner.stashes[write] and takes pending rows from the other one."""
        runner, rows, dev = self.runner, self.rows, self.runner.device
        t = b * rows
        ring = self.ring
        ints = torch.zeros(2 * t + b + (ring is not None), dtype=torch.long, device=dev)
        input_ids, positions, num_drafts = ints[:t], ints[t:2 * t], ints[2 * t:2 * t + b]
        if ring is not None:  # the warm-up and build runs write the scratch slot
            ring_at = ints[2 * t + b:]
            ring_at.fill_(self.ring_steps * self.batch_buckets[-1])
            ring_cols = torch.arange(t, dtype=torch.long, device=dev)
        attn = PagedMetadata.allocate(b, rows, self.max_kv_len, runner.kv.page_size, dev)
        meta = GDNMetadata(self.phase, torch.zeros(b, dtype=torch.int32, device=dev),
                           torch.arange(0, t + 1, rows, dtype=torch.int32, device=dev), rows)
        if self.phase is Phase.VERIFY:  # pending rows: a static buffer, zeros when none
            meta.stash = runner.stashes[write]
            meta.pending = (runner.stashes[1 - write], torch.zeros(b, dtype=torch.int32,
                                                                     device=dev))
        gdn = PoolGDNBackend(runner.state_pool, meta)

        def step() -> tuple[torch.Tensor, ...]:
            ctx = ForwardContext(positions=positions,
                                 attn=PagedAttentionBackend(runner.kv, attn), gdn=gdn)
            hidden = runner.model.forward(input_ids, ctx)
            logits = runner.model.compute_logits(hidden)
            greedy = logits.argmax(dim=-1)
            # verify: the drafts are rows 1..k of each request's input ids
            accepted = (pack_greedy(greedy, input_ids.view(b, rows)[:, 1:], num_drafts)
                        if rows > 1 else None)
            if ring is not None:
                ring.index_copy_(0, ring_at + ring_cols, hidden)
            return hidden, logits, greedy, accepted

        if not self.capture:
            return _Graph(step, ints, input_ids, positions, attn, gdn, *step())
        graph, outputs = capture(step, self.pool)
        return _Graph(lambda: graph.replay(), ints, input_ids, positions, attn, gdn, *outputs)


def build_graph_runners(cfg: EngineConfig, model, runner: ModelRunner, spec,
                        max_model_len: int) -> tuple[GraphRunner | None, GraphRunner | None]:
    """The engine's graph runners: (the step graphs: verify graphs with speculation, else
    decode graphs; the decode graphs of the plain steps an adaptive policy picks, else None).
    Both None off CUDA, with `cfg.cuda_graphs` off, or for a MoE model whose experts would sync
    with the host at the largest batch (logged). With MTP graphs on, `spec.use_graphs` gets the
    same batch bound. Raises nothing of its own."""
    if not cfg.cuda_graphs or runner.device.type != "cuda":
        return None, None
    rows = cfg.max_running_reqs * cfg.decode_rows_per_req
    if not moe_graph_safe(model, rows):
        logger.warning("MoE experts in %s would sync with the host at %d rows (no sync-free "
                       "grouped GEMM for this GPU and dtype; the gathered form exceeds its "
                       "memory budget): CUDA graphs are off", next(model.parameters()).dtype, rows)
        return None, None
    graphs = GraphRunner(runner, cfg.max_running_reqs, cfg.decode_rows_per_req, max_model_len)
    if spec is not None and cfg.mtp_cuda_graphs:  # same buckets, same bound
        spec.use_graphs(cfg.max_running_reqs, max_model_len)
    plain = None
    if spec is not None and cfg.speculative_policy != "fixed":
        plain = GraphRunner(runner, cfg.max_running_reqs, 1, max_model_len,
                            hidden_ring=hidden_ring_steps(spec, model, cfg.max_running_reqs))
    return graphs, plain


RING_BYTES = 64 << 20  # the most a hidden-state ring takes (else the host clones)
RING_MARGIN = 8  # ring steps past those the proposer holds


def ring_held_fit(step_bytes: int) -> int:
    """The most steps a proposer may hold a step's hidden rows of `step_bytes` (all its
    requests) while the ring that serves them stays within RING_BYTES (hidden_ring_steps)."""
    return RING_BYTES // max(step_bytes, 1) - 1 - RING_MARGIN


def hidden_ring_steps(spec, model, max_reqs: int) -> int:
    """Steps of the plain decode graphs' hidden-state ring: those the proposer may hold a
    step's hidden rows, plus RING_MARGIN; 0 (clone after each replay) when the proposer takes
    no hidden states, holds them without a bound, or the ring would pass RING_BYTES (one
    more step than it has is allocated: the scratch slot)."""
    held = spec.proposer.hidden_steps_held if spec.wants_hidden else 0
    if not held:
        return 0
    step_bytes = max_reqs * model.config.hidden_size * model.dtype.itemsize
    return held + RING_MARGIN if held <= ring_held_fit(step_bytes) else 0


def _chain_inputs(g: _Graph, chain: VerifyChain, n: int, rows: int) -> None:
    """Move a chained verify step's rows to where the previous step left each request: the
    staged positions start at chain.starts and the staged lengths assume every draft was
    accepted (starts + rows, the pages filled that far); the pending token is the previous
    step's target token at its last committed row."""
    counts = chain.counts
    g.positions.view(-1, rows)[:n].add_(counts[:, None])
    g.attn.kv_lens[:n].add_((counts - rows).to(g.attn.kv_lens.dtype))
    last = torch.gather(chain.greedy, 1, (counts - 1)[:, None])
    g.input_ids.view(-1, rows)[:n, :1].copy_(last)


def capture(step: Callable[[], Any], pool) -> tuple[torch.cuda.CUDAGraph, Any]:
    """Capture `step` (no arguments, static buffers) as a CUDA graph in memory pool `pool`.

    Two warm-up calls on a side stream first, so lazy initialisation and autotuning happen
    outside the graph. The graph holds `step` (and so every tensor it closes over) for as long
    as the graph lives. Returns (graph, what the captured call returned: its static outputs).
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = step()
    # The graph replays the addresses of every tensor `step` closes over (metadata buffers,
    # index vectors made before capture); only Python references keep them allocated. Without
    # this, the allocator hands their memory to other tensors once the caller drops `step`, and
    # replays read garbage (seen on the H200: the MTP step's row index, then an index assert).
    graph.keep_alive = step
    return graph, out
