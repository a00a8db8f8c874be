"""Kernels per decode step and the host gap per step (issue 27's figures), for bench_e2e.py.

- kernels: torch.profiler's count of CUDA kernels (memcpy / memset excluded) launched by one
  decode step at batch 1 that replays a captured graph; per layer = that count / layers
  (embedding, final norm, lm_head and argmax are in the count too). Target: <= 14 a layer.
- host gap: wall time of `LLMEngine.step()` per decode step minus the device time of the
  step's graph replay alone (CUDA events around `replay()`, same bucket). Target: <= 5% of it.

On a CPU (`python benchmarks/step_kernels.py`) it counts the top-level aten ops of each layer of
one eager decode step of a tiny checkpoint instead: the ops a GPU step would launch as kernels
before fusion by graphs (a GEMM is one op; a fused op of ops/fused.py is several aten ops on
CPU until its CUDA kernel lands, one kernel after).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from deltaserve import SamplingParams

NOT_KERNELS = ("Memcpy", "Memset", "memcpy", "memset")
VIEW_OPS = {f"aten::{n}" for n in ("view", "reshape", "slice", "select", "split", "unsqueeze",
                                   "split_with_sizes", "transpose", "detach", "expand", "t",
                                   "as_strided", "alias", "permute", "chunk", "unbind")}


def decode_request(eng, vocab: int, tokens: int = 64) -> None:
    """Admit a 128-token greedy request and run it past its prefill and first decode step."""
    ids = [(7 * i + 3) % (vocab - 1) for i in range(128)]
    eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    for _ in range(3):
        eng.step()


def kernels_per_step(eng, vocab: int) -> dict:
    """CUDA kernels of one graph-replayed batch-1 decode step (see the module doc)."""
    decode_request(eng, vocab)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    names = Counter(e.name for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA
                    and not e.name.startswith(NOT_KERNELS))
    while eng.has_unfinished():
        eng.step()
    layers = eng.model.config.num_hidden_layers
    total = sum(names.values())
    if total == 0:
        print("the profiler saw no kernel of the graph replay (no CUPTI graph tracing?): the "
              "count below is not the step's", flush=True)
    return {"kernels_per_step": total, "kernels_per_layer": total / layers,
            "kernel_names": dict(names.most_common())}


def host_gap(eng, vocab: int, steps: int = 32) -> dict:
    """Wall time per decode step, device time of its graph replay, and the gap between them."""
    decode_request(eng, vocab, tokens=steps + 8)
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    replay = eng.graphs.graphs[(1,)].replay  # the batch-1 graph the last step replayed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(steps):  # replays rerun the last step's inputs: the request is dropped after
        start.record()
        replay()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3)
    for rid in list(eng._reqs):
        eng.abort(rid)
    wall, dev = statistics.median(walls), statistics.median(device)
    return {"step_wall_s": wall, "step_device_s": dev, "host_gap_s": wall - dev,
            "host_gap_share": (wall - dev) / wall}


def cpu_ops_per_layer(path: str) -> dict[str, Counter]:
    """Top-level aten ops of each decoder layer in one eager CPU decode step (batch 1)."""
    from deltaserve import LLM

    llm = LLM(path, device="cpu", dtype="float32", num_pages=64, page_size=16,
              max_running_reqs=2)
    eng = llm.engine
    decode_request(eng, eng.model.config.vocab_size)
    ranges = {}
    for i, layer in enumerate(eng.model.layers):
        kind = "gdn" if layer.is_gdn else "attention"
        layer.register_forward_pre_hook(
            lambda m, a, i=i, kind=kind: ranges.__setitem__(
                i, record_function(f"layer.{kind}").__enter__()))
        layer.register_forward_hook(lambda m, a, out, i=i: ranges.pop(i).__exit__(None, None, None))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.step()
    out: dict[str, Counter] = {}
    for e in prof.events():
        parent = e.cpu_parent
        if parent is not None and parent.name.startswith("layer.") and e.name.startswith("aten"):
            out.setdefault(f"{parent.name}#{parent.id}", Counter())[e.name] += 1
    return out


def main() -> None:
    from pathlib import Path
    from tempfile import mkdtemp

    from deltaserve.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(Path(mkdtemp()) / "m", "qwen3_5_text")
    per_layer = cpu_ops_per_layer(str(path))
    seen = set()
    for key, ops in per_layer.items():
        kind = key.split("#")[0]
        if kind in seen:
            continue
        seen.add(kind)
        compute = {k: n for k, n in ops.items() if k not in VIEW_OPS}
        print(f"{kind}: {sum(ops.values())} top-level aten ops, {sum(compute.values())} not "
              "views (fp32: aten::to is a no-op)")
        for name, n in sorted(compute.items()):
            print(f"    {n:3d}  {name}")


if __name__ == "__main__":
    main()
