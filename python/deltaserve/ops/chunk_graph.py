"""Replay one prefill forward's GDN chunk pipeline as a CUDA graph from its second layer on.

Why: fla-core's chunk stages are Triton kernels, and each launch goes through Triton's Python
launcher, fla's autotune cache and dispatch wrappers. On an H100 (session 36) a 256-token
prompt's first token takes 29 ms with the device busy 9% of it; under cProfile the 108 Triton
launches of its 18 GDN layers are 28 of the 58 ms the profiled call took (1.5 ms a layer).
Every GDN layer of a forward runs the pipeline on the same shapes and the same `PrefillIndex`,
so the launches of one layer can be recorded once and replayed for the others: the inputs are
copied into static buffers, the graph replays, the outputs are copied out.

Per forward and per input signature (shapes, dtypes): the first call runs eagerly on the static
buffers (Triton compiles and autotunes there, for exactly the pointers and sizes the capture
will see: a capture may not compile or benchmark), the second captures and replays, the later
ones only replay. Once a call of the same signature class (`warm_key`: the signature less the
token count) has run eagerly in this process, a forward's first call captures at once: fla-core
compiles none of these kernels per token count (`do_not_specialize=['T']`) and keys none of its
autotuning on it, so a new prompt length finds every kernel built and tuned, and the forward
launches its pipeline through Python once instead of twice (session 47, one H100, runs
alternated: about 2.5 ms off the 16-19 ms first token of 256-2,000-token prompts). The results
must be bitwise the eager pipeline's (the same kernels on the same inputs), which
tests/ops/test_gdn_prefill_gpu.py asserts. The capture runs on a side stream without the
synchronize and garbage collection of `torch.cuda.graph` (a stall the prefill would feel);
replays run on the caller's stream, after its copies. Every capture allocates from one graph
memory pool per device (`torch.cuda.graph_pool_handle`), which a one-op "anchor" graph captured
into it first keeps alive as long as the process: a forward's graph frees its blocks to that
pool when the forward is dropped and the next forward's capture takes them again (without the
anchor, each dead graph's pool would stay reserved until an allocation failed and the allocator
synchronised to free it). Reuse is safe in stream order: every replay runs on the caller's
stream, so the old graph's has been queued before the new. (`torch.cuda.MemPool` would say the
same more directly, but a capture into one fails in torch 2.11: the pinned-host allocator's pool
bookkeeping asserts, `use_count > 0`, on the first capture; measured on an H100 in session 37.)

`DS_PREFILL_GRAPH_TOKENS` is the largest forward, in tokens, that is replayed (0: off; default
2048). The copies in and out cost device time in proportion to the tokens, the launches they
replace a fixed host time a layer, so the replay pays where the forward is host bound. On an
H100 (session 37, the 0.8B config, two runs each way in one call) it took a 256-token prompt's
first token from 27.9 / 28.7 ms to 16.4 / 16.2 ms and a cached follow-up's from 30.7 to 18.1
ms, and cost an 8,192-token prefill 6% (233k against 246-254k tok/s: that forward is device
bound, 86% busy, so it had no launch time to save). 2048 keeps the replay below where a
layer's chunk kernels take as long as its launches (about 4k tokens, from fla's 0.9 ms a
layer at 8k on the H200, BUILD.md); the crossover itself was not measured. A capture that
fails turns replays off for the process (eager from then on).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from deltaserve.ops import _ext

logger = logging.getLogger(__name__)

DEFAULT_MAX_TOKENS = 2048  # below the measured 8k loss, at the measured 256-token gain
_MOST_TOKENS = 1 << 20
_state = {"failed": False, "warm": True}  # warm: first calls of warmed classes capture
# signature classes (ReplayedCall.warm_key) whose pipeline ran eagerly in this process
_warmed: set[tuple] = set()
_side_streams: dict[int, torch.cuda.Stream] = {}
# per device: the graph pool's handle, and the anchor graph and its tensor that keep it alive
_pools: dict[int, tuple] = {}


def max_tokens() -> int:
    """DS_PREFILL_GRAPH_TOKENS: the largest forward (tokens) whose pipeline is replayed; 0 off.
    Raises ValueError on a value that is not an integer in 0..2^20."""
    return _ext.count_from_env("DS_PREFILL_GRAPH_TOKENS", DEFAULT_MAX_TOKENS, _MOST_TOKENS)


def eligible(num_tokens: int, sample: torch.Tensor) -> bool:
    """Whether a forward of `num_tokens` rows on `sample`'s device may replay its pipeline."""
    return (sample.is_cuda and not _state["failed"] and 0 < num_tokens <= max_tokens()
            and not torch.cuda.is_current_stream_capturing())


class ReplayedCall:
    """`fn(*inputs)` over fixed-shape CUDA tensors: eager on the first call, captured on the
    second, replayed after (see the module doc); captured on the first call already when
    `warm_key` (None: never) ran eagerly before in this process. `fn` must return a tuple of
    tensors and may not sync the host. Each call returns fresh tensors (copies of the graph's
    outputs), so the caller's contract is that of `fn` itself."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]],
                 inputs: tuple[torch.Tensor, ...], warm_key: tuple | None = None) -> None:
        self.fn = fn
        self.static = tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device)
                            for x in inputs)
        self.warm_key = warm_key
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: tuple[torch.Tensor, ...] = ()
        self.calls = 0

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        for s, x in zip(self.static, inputs, strict=True):
            s.copy_(x)
        self.calls += 1
        if _state["failed"]:
            return self.fn(*self.static)
        if self.graph is None:
            if self.calls == 1 and not (_state["warm"] and self.warm_key in _warmed):
                out = self.fn(*self.static)
                if self.warm_key is not None:
                    _warmed.add(self.warm_key)
                return out
            if not self._capture(first=self.calls == 1):
                return self.fn(*self.static)
        self.graph.replay()
        return tuple(o.clone() for o in self.outputs)

    def _capture(self, first: bool = False) -> bool:
        """Capture `fn` on the static inputs; False if the capture failed (_capture_failed;
        first: a forward's first call, of a warmed class)."""
        device = self.static[0].device
        try:
            pool = _pool(device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.stream(_side_streams[device.index]):
                graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    outputs = self.fn(*self.static)
                finally:
                    graph.capture_end()
        except RuntimeError as e:  # e.g. a kernel that syncs the host: eager from now on
            return _capture_failed(first, e)
        self.graph, self.outputs = graph, tuple(outputs)
        return True


def _capture_failed(first: bool, error: Exception) -> bool:
    """After a failed capture: replays off for the process, or, at a forward's first call, only
    the captures at first calls (eager first calls again, as before any class was warmed).
    Returns False."""
    if first:
        _state["warm"] = False
    else:
        _state["failed"] = True
    logger.warning("prefill pipeline %s off: its capture failed (%s)",
                   "capture at a forward's first call" if first else "replay",
                   str(error).splitlines()[0] if str(error) else type(error).__name__)
    return False


def _pool(device: torch.device):
    """The graph pool of `device`'s captures (and its side stream), made with the anchor graph
    that keeps the pool alive on first use."""
    if device.index not in _pools:
        side = _side_streams.setdefault(device.index, torch.cuda.Stream(device))
        with torch.cuda.device(device):
            pool = torch.cuda.graph_pool_handle()
            anchor = torch.cuda.CUDAGraph()
            with torch.cuda.stream(side):
                anchor.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    kept = torch.zeros(1, device=device)
                finally:
                    anchor.capture_end()
        _pools[device.index] = (pool, anchor, kept)
    return _pools[device.index][0]


def replayed(cache: dict, key: tuple, make: Callable[[], Callable[..., tuple[torch.Tensor, ...]]],
             inputs: tuple[torch.Tensor, ...], warm_key: tuple | None = None
             ) -> tuple[torch.Tensor, ...]:
    """`fn(*inputs)` through the ReplayedCall that `cache` (one forward's) holds for `key`,
    made on first use with `fn = make()` and `warm_key` (ReplayedCall). `fn` closes over
    everything but `inputs` that it reads; those must stay the same, and alive, for as long as
    `cache` lives (and must not reference `cache`: the graphs would then wait for the garbage
    collector)."""
    call = cache.get(key)
    if call is None:
        call = cache[key] = ReplayedCall(make(), inputs, warm_key)
    return call(*inputs)
