"""Where a step's wall time goes: per-step wall-time distribution of decode, and host/device
profiles of decode and of a short prompt's time to first token, on the 0.8B config.

bench_e2e.py gives the headline figures; this script explains them. It prints, for decode at
batch 1 and 32: the distribution of `LLMEngine.step()` wall times (median, mean, p90, max;
a mean far above the median means some steps are slow) beside tok/s of `LLM.generate`; then
cProfile's top functions (cumulative) of one `generate` of a decode run and of a 256-token
prompt's first token; then torch.profiler's top CPU ops and CUDA kernels of that prompt.

    python benchmarks/profile_step.py --vocab 248320 --out profile.txt
    python benchmarks/profile_step.py --model default --out profile_default.txt
    python benchmarks/profile_step.py --vocab 248320 --disable-overlap-schedule  # synchronous
    python benchmarks/profile_step.py --model default --spec mtp --out profile_mtp.txt
    python benchmarks/profile_step.py --model default --spec mtp --overlap-verify  # chained
    python benchmarks/profile_step.py --model default --spec mtp --plain  # on, never verifying

With --spec ALGO (k = 3, fixed policy: every decode step verifies) the decode figures are verify
steps' (issue 30: a verify step cost 3.1 plain steps on the default model). torch.profiler
also covers a batch-1 decode run: the host's time per step beside the kernels', and each graph
launch's span on the device (graph_spans).

With overlap scheduling (the default) a decode call launches step n+1 and lands step n, so a
step's wall time is the longer of the host's and the device's work, not their sum.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time

import torch
from bench_e2e import build_checkpoint, given_checkpoint, prompt  # a sibling script

from deltaserve import LLM, SamplingParams


def step_walls(llm: LLM, batch: int, vocab: int, steps: int) -> dict:
    """Wall seconds of every decode step of `batch` 128-token greedy requests."""
    eng = llm.engine
    for i in range(batch):
        eng.add_request(prompt(128, vocab, 200 + i),
                        SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True))
    while any(r.device_len < r.prompt_len for r in eng.scheduler.running) \
            or eng.scheduler.waiting:
        eng.step()
    torch.cuda.synchronize()
    walls = []
    while eng.has_unfinished():
        t = time.perf_counter()
        eng.step()
        walls.append(time.perf_counter() - t)
    walls = walls[2:-2]
    walls.sort()
    return {"median_ms": 1e3 * statistics.median(walls), "mean_ms": 1e3 * statistics.mean(walls),
            "p90_ms": 1e3 * walls[int(0.9 * len(walls))], "max_ms": 1e3 * walls[-1],
            "n": len(walls)}


def cprofile(fn, limit: int = 45) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    torch.cuda.synchronize()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(limit)
    s.write("\n--- by self time ---\n")
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    return s.getvalue()


def torch_profile(fn, steps=None) -> str:
    """torch.profiler's CPU and CUDA op tables of fn(); with `steps` (a callable giving the
    engine's step count), first a line with the device time per step that fn ran and the
    graph launches' spans (graph_spans)."""
    from torch.profiler import ProfilerActivity, profile

    n0 = steps() if steps else 0
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    wall = time.perf_counter() - t
    ka = prof.key_averages()
    head = ""
    if steps:
        n = max(steps() - n0, 1)
        device_us = sum(e.self_device_time_total for e in ka)
        head = (f"{n} steps: device {device_us / n:.1f} us a step (kernels' own time), wall "
                f"{1e6 * wall / n:.1f} us a step (profiled)\n{graph_spans(prof, n)}\n")
    return (head + ka.table(sort_by="cpu_time_total", row_limit=40) + "\n"
            + ka.table(sort_by="self_device_time_total", row_limit=40))


def graph_spans(prof, steps: int) -> str:
    """Per CUDA-graph launch of a profiled run: its kernels' span on the device (first start to
    last end), grouped by kernels per launch (one group a graph family: with --spec mtp the
    verify graph and the MTP graph), beside the device's busy time (union of all kernels) and
    the kernels launched outside graphs, per step. Kernel durations alone overstate a step
    where kernels start early and wait (programmatic dependent launch); spans do not."""
    from torch.autograd import DeviceType

    evs = prof.profiler.kineto_results.events()
    launches = {e.correlation_id() for e in evs if e.name() == "cudaGraphLaunch"}
    kernels = [e for e in evs if e.device_type() == DeviceType.CUDA and e.duration_ns() > 0
               and "Memcpy" not in e.name() and "Memset" not in e.name()]
    groups: dict[int, list] = {}
    eager = 0
    for k in kernels:
        cid = k.linked_correlation_id() or k.correlation_id()
        if cid in launches:
            groups.setdefault(cid, []).append(k)
        else:
            eager += 1
    fams: dict[int, list[float]] = {}
    for ks in groups.values():
        span = max(k.end_ns() for k in ks) - min(k.start_ns() for k in ks)
        fams.setdefault(len(ks), []).append(span / 1e3)
    busy, end = 0, 0
    for k in sorted(kernels, key=lambda k: k.start_ns()):  # union of the kernels' intervals
        s, e = k.start_ns(), k.end_ns()
        busy += max(0, e - max(s, end))
        end = max(end, e)
    n = max(steps, 1)
    lines = [f"device busy {busy / 1e3 / n:.1f} us a step (union of kernels), "
             f"{eager / n:.1f} kernels a step outside graphs; graph launches by kernel count:"]
    for nk, spans in sorted(fams.items()):
        lines.append(f"  {nk:4d} kernels: {len(spans):4d} launches, span median "
                     f"{statistics.median(spans):7.1f} us, mean {statistics.mean(spans):7.1f}")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--out", default="profile.txt")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="synchronous decode steps (engine/overlap.py is on by default)")
    ap.add_argument("--spec", choices=["mtp", "ngram"], default=None,
                    help="speculative decoding, k = 3, every step a verify (fixed policy)")
    ap.add_argument("--overlap-verify", action="store_true",
                    help="with --spec mtp: verify steps chained behind unlanded ones")
    ap.add_argument("--plain", action="store_true",
                    help="with --spec: the adaptive engine with every decode step forced to "
                         "plain decode (what speculation being on costs a step)")
    args = ap.parse_args()
    spec = (dict(speculative_algorithm=args.spec, speculative_num_steps=3,
                 speculative_policy="adaptive" if args.plain else "fixed",
                 overlap_verify=args.overlap_verify)
            if args.spec else {})
    out = []

    def say(s: str) -> None:
        print(s, flush=True)
        out.append(s)

    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            build_checkpoint(tmp, 1024, 24, args.vocab)
            path = tmp
        else:
            path, _, args.vocab = given_checkpoint(args.model)
        llm = LLM(path, device="cuda", dtype="bfloat16", kv_memory_gb=8.0, page_size=16,
                  chunk_size=8192, max_num_batched_tokens=8192, max_running_reqs=64,
                  overlap_schedule=not args.disable_overlap_schedule, **spec)
        if args.plain:
            llm.engine.scheduler.choose_drafts = lambda reqs: 0
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        dec = SamplingParams(temperature=0.0, max_tokens=args.steps, ignore_eos=True)
        for b in (1, 32):  # warm-up: graphs, Triton compiles
            llm.generate([prompt(128, args.vocab, 100 + i) for i in range(b)], dec)
        for _ in range(2):
            llm.engine.flush_cache()
            llm.generate([prompt(256, args.vocab, 7)], one)
        for b in (1, 32):
            st = step_walls(llm, b, args.vocab, args.steps)
            ps = [prompt(128, args.vocab, 300 + i) for i in range(b)]
            llm.engine.flush_cache()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate(ps, one)
            torch.cuda.synchronize()
            t1 = time.perf_counter()
            llm.engine.flush_cache()
            llm.generate(ps, dec)
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            per_tok = ((t2 - t1) - (t1 - t0)) / (args.steps - 1)
            say(f"batch {b}: step wall {st}; generate: {1e3 * per_tok:.3f} ms per step, "
                f"{b / per_tok:.0f} tok/s")
        llm.engine.flush_cache()
        say("=== cProfile: generate, batch 1, decode ===")
        ps = [prompt(128, args.vocab, 400)]
        say(cprofile(lambda: llm.generate(ps, dec)))
        for i in range(3):
            llm.engine.flush_cache()
            torch.cuda.synchronize()
            t = time.perf_counter()
            llm.generate([prompt(256, args.vocab, 20 + i)], one)
            torch.cuda.synchronize()
            say(f"ttft 256: {1e3 * (time.perf_counter() - t):.1f} ms")
        llm.engine.flush_cache()
        say("=== cProfile: ttft 256 ===")
        say(cprofile(lambda: llm.generate([prompt(256, args.vocab, 30)], one)))
        llm.engine.flush_cache()
        say(f"=== torch.profiler: decode with {args.spec or 'no speculation'}, batch 1 "
            "(the 128-token prefill included) ===")
        say(torch_profile(lambda: llm.generate([prompt(128, args.vocab, 401)], dec),
                          steps=lambda: llm.engine.num_steps))
        if args.spec and not args.plain:
            say(f"acceptance length {llm.engine.acceptance_length}")
        llm.engine.flush_cache()
        say("=== torch.profiler: ttft 256 ===")
        say(torch_profile(lambda: llm.generate([prompt(256, args.vocab, 31)], one)))
    with open(args.out, "w") as f:
        f.write("\n".join(out))


if __name__ == "__main__":
    main()
