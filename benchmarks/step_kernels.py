"""Kernels per decode step and the host gap per step (issue 27's figures), for bench_e2e.py.

- kernels: torch.profiler's count of CUDA kernels (memcpy / memset excluded) launched by one
  decode step at batch 1 that replays a captured graph; per layer = that count / layers
  (embedding, final norm, lm_head and argmax are in the count too, and with overlap
  scheduling the gather of the previous step's tokens into the inputs). Target: <= 14 a layer.
- host gap: wall time of `LLMEngine.step()` per decode step minus the device time of the
  step's graph replay alone (CUDA events around `replay()`, same bucket). Target: <= 5% of it.
  With overlap scheduling (engine/overlap.py, on by default) the host builds step n+1 while
  the GPU runs step n, so this is the host time the GPU does not hide; `overlap_table` gives
  it with overlap on and off at batch 1 and 32, beside decode tok/s (batch / wall per step)
  and the device-bound tok/s (batch / graph device time per step).

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


def decode_request(eng, vocab: int, tokens: int = 64, batch: int = 1) -> None:
    """Admit `batch` 128-token greedy requests and run them past their prefill and first two
    decode steps (with overlap scheduling the first decode call only launches)."""
    for i in range(batch):
        ids = [(7 * i + 13 * j + 3) % (vocab - 1) for j in range(128)]
        eng.add_request(ids, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    while eng.scheduler.waiting or any(r.in_prefill for r in eng.scheduler.running):
        eng.step()
    for _ in range(2):
        eng.step()


def kernels_per_step(eng, vocab: int) -> dict:
    """CUDA kernels of one graph-replayed batch-1 decode step (see the module doc)."""
    decode_request(eng, vocab)
    # with overlap the step in flight would finish inside the window: count one step alone
    torch.cuda.synchronize()
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


def host_gap(eng, vocab: int, steps: int = 32, batch: int = 1,
             overlap: bool | None = None) -> dict:
    """Wall time per decode step of `batch` requests, device time of its graph replay, and the
    gap between them (wall - device: the host time the GPU does not hide). overlap: switch
    overlap scheduling on/off for the run (None: as configured; engine/overlap.py). With
    overlap a step's wall time is max(device, host) plus what does not overlap, so the gap
    shrinks to the host work that cannot run ahead; tok/s is batch / wall, and
    `device_tok_s` = batch / device is what a gap of 0 would give."""
    ov = eng.overlap
    was = ov.enabled if ov is not None else None
    if ov is not None and overlap is not None:
        ov.enabled = overlap
    decode_request(eng, vocab, tokens=steps + 8, batch=batch)
    torch.cuda.synchronize()
    walls = []
    for _ in range(steps):
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    torch.cuda.synchronize()
    bucket = next(b for b in eng.graphs.batch_buckets if b >= batch)
    replay = eng.graphs.graphs[(bucket,)].replay  # the graph the last step replayed
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    device = []
    for _ in range(steps):  # replays rerun the last step's inputs: the requests are dropped after
        start.record()
        replay()
        end.record()
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3)
    for rid in list(eng._reqs):
        eng.abort(rid)
    eng.step()  # lands (and discards) a step still in flight
    if ov is not None:
        ov.enabled = was
    wall, dev = statistics.median(walls), statistics.median(device)
    return {"step_wall_s": wall, "step_device_s": dev, "host_gap_s": wall - dev,
            "host_gap_share": (wall - dev) / wall, "tok_s": batch / wall,
            "device_tok_s": batch / dev,
            "overlap": bool(ov is not None and (ov.enabled if overlap is None else overlap))}


def overlap_table(eng, vocab: int, batches: tuple[int, ...] = (1, 32), steps: int = 32) -> dict:
    """host_gap with overlap scheduling on and off at each batch size (off only when the
    engine has no overlap scheduler: --disable-overlap-schedule). Prints one line per run;
    returns {"b{batch}_{on|off}": host_gap's dict}."""
    modes = (True, False) if eng.overlap is not None else (False,)
    out = {}
    print(f"{'decode':10s} {'overlap':8s} {'wall/step':>10s} {'graph/step':>11s} "
          f"{'host gap':>9s} {'tok/s':>9s} {'device-bound tok/s':>19s}", flush=True)
    for batch in batches:
        for on in modes:
            r = host_gap(eng, vocab, steps, batch, overlap=on if eng.overlap else None)
            out[f"b{batch}_{'on' if on else 'off'}"] = r
            print(f"{'batch ' + str(batch):10s} {'on' if on else 'off':8s} "
                  f"{1e3 * r['step_wall_s']:8.3f}ms {1e3 * r['step_device_s']:9.3f}ms "
                  f"{100 * r['host_gap_share']:8.1f}% {r['tok_s']:9.0f} "
                  f"{r['device_tok_s']:19.0f}", flush=True)
    return out


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
