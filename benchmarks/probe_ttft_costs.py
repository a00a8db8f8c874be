"""Probe: where a prompt's time to first token goes beyond the prefill itself (issue 27).

Part 1, one-time costs by length: the TTFT of cold prompts (prefix cache flushed) at lengths the
process has not run, each length twice in a row ("first", "again"); the difference is what a
length pays the first time (Triton compiles and autotunes per shape bucket, graph captures).
Part 2, the cached follow-up: bench_e2e's protocol (a long prompt, a 32-token answer, then the
prompt + answer + 256 new tokens), its TTFT against a prefill of only the uncached tokens,
median of --repeats, then one follow-up and one new-only prefill each under torch.profiler
(host ops by self time, kernels by device time, the device's busy time) and under cProfile
(deltaserve's functions by cumulative time): what the follow-up's extra milliseconds are.
Part 3, `--concurrent N` follow-up turns of N conversations at once against N prompts of their
new tokens alone (a batched prefill past PER_REQUEST_MAX: prefill attention's varlen path).

    python benchmarks/probe_ttft_costs.py --vocab 248320 --out ttft_costs.json   # 0.8B config
    python benchmarks/probe_ttft_costs.py --model default --out ttft_costs_def.json
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import tempfile

import torch
from bench_e2e import build_checkpoint, given_checkpoint, prompt, timed  # a sibling script
from torch.profiler import ProfilerActivity, profile

from deltaserve import LLM, SamplingParams

LENGTHS = (100, 200, 257, 300, 500, 513, 700, 1000, 1025, 1500, 2000, 2049, 2500, 4000, 4097,
           6000)


def first_costs(llm: LLM, vocab: int, one: SamplingParams, lengths=LENGTHS) -> dict:
    out = {}
    for n in lengths:
        row = []
        for rep in range(2):
            llm.engine.flush_cache()
            row.append(round(timed(llm.generate, [prompt(n, vocab, 1000 + 2 * n + rep)], one)
                             * 1e3, 2))
        out[n] = {"first_ms": row[0], "again_ms": row[1]}
        print(f"TTFT at {n:5d} tokens: first {row[0]:8.2f} ms, again {row[1]:8.2f} ms",
              flush=True)
    return out


def prime(llm: LLM, longs: list[list[int]], vocab: int, seed: int = 2) -> list[list[int]]:
    """Flush, prefill each of `longs`, answer 32 tokens each; returns the follow-up prompts
    (each a long prompt, its answer and 256 new tokens of seed `seed` + i: prefix cached)."""
    llm.engine.flush_cache()
    llm.generate(longs, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    answers = llm.generate(longs, SamplingParams(temperature=0.0, max_tokens=32,
                                                 ignore_eos=True))
    return [lg + a.token_ids + prompt(256, vocab, seed + i)
            for i, (lg, a) in enumerate(zip(longs, answers))]


def device_busy_ms(prof) -> float:
    """The union of the kernels' and copies' intervals on the device (ms)."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA)
    busy, end = 0.0, -1.0
    for s, e in spans:
        if s > end:
            busy, end = busy + (e - s), e
        elif e > end:
            busy, end = busy + (e - end), e
    return busy / 1e3


def profiled(llm: LLM, ids: list[int], one: SamplingParams, label: str) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        llm.generate([ids], one)
        torch.cuda.synchronize()
    ka = prof.key_averages()
    host = ka.table(sort_by="self_cpu_time_total", row_limit=25)
    dev = ka.table(sort_by="cuda_time_total" if hasattr(ka[0], "cuda_time_total")
                   else "device_time_total", row_limit=20)
    busy = device_busy_ms(prof)
    print(f"--- {label}: device busy {busy:.2f} ms\n{host}\n{dev}", flush=True)
    return {"device_busy_ms": busy, "host_table": host, "device_table": dev}


def cprofiled(llm: LLM, ids: list[int], one: SamplingParams, label: str) -> str:
    pr = cProfile.Profile()
    torch.cuda.synchronize()
    pr.enable()
    llm.generate([ids], one)
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats("deltaserve", 45)
    print(f"--- cProfile {label}\n{s.getvalue()}", flush=True)
    return s.getvalue()


def followup(llm: LLM, vocab: int, long_tokens: int, repeats: int, one) -> dict:
    long = prompt(long_tokens, vocab, 1)
    res: dict = {"followup_ms": [], "new_only_ms": []}
    follow = prime(llm, [long], vocab)[0]  # compiles for these shapes
    llm.generate([follow], one)
    for _ in range(repeats):
        follow = prime(llm, [long], vocab)[0]
        torch.cuda.synchronize()
        res["followup_ms"].append(round(timed(llm.generate, [follow], one) * 1e3, 3))
    # the uncached part alone, the same length as the follow-up's uncached tokens (primed
    # again: the timed run cached the follow-up itself, which left 32 tokens uncached)
    (out,) = llm.generate(prime(llm, [long], vocab), one)
    res["followup_cached_tokens"] = out.cached_tokens
    new_only = prompt(len(follow) - out.cached_tokens, vocab, 3)
    for _ in range(repeats):
        llm.engine.flush_cache()
        res["new_only_ms"].append(round(timed(llm.generate, [new_only], one) * 1e3, 3))
    f, n = statistics.median(res["followup_ms"]), statistics.median(res["new_only_ms"])
    res["ratio"] = f / n
    print(f"follow-up {f:.2f} ms (cached {out.cached_tokens}) vs its new tokens alone "
          f"({len(new_only)}) {n:.2f} ms: {f / n:.3f}x; all {res}", flush=True)
    follow = prime(llm, [long], vocab)[0]
    res["profile_followup"] = profiled(llm, follow, one, "follow-up")
    llm.engine.flush_cache()
    res["profile_new_only"] = profiled(llm, new_only, one, "new tokens alone")
    follow = prime(llm, [long], vocab)[0]
    res["cprofile_followup"] = cprofiled(llm, follow, one, "follow-up")
    llm.engine.flush_cache()
    res["cprofile_new_only"] = cprofiled(llm, new_only, one, "new tokens alone")
    return res


def concurrent_followups(llm: LLM, vocab: int, long_tokens: int, n: int, repeats: int,
                         one) -> dict:
    """`n` conversations' follow-up turns arriving at once (each `long_tokens` cached, a
    32-token answer and 256 new tokens): the batch's time to its last first token against
    the same number of prompts of their uncached tokens alone, medians of `repeats`. Past
    PER_REQUEST_MAX requests the prefill's attention takes the varlen (or padded) path."""
    longs = [prompt(long_tokens, vocab, 100 + i) for i in range(n)]

    def primed() -> list[list[int]]:
        return prime(llm, longs, vocab, seed=200)

    res: dict = {"requests": n, "followup_ms": [], "new_only_ms": []}
    llm.generate(primed(), one)  # compiles for these shapes
    for _ in range(repeats):
        follows = primed()
        torch.cuda.synchronize()
        res["followup_ms"].append(round(timed(llm.generate, follows, one) * 1e3, 3))
    outs = llm.generate(primed(), one)
    res["cached_tokens"] = [o.cached_tokens for o in outs]
    new_only = [prompt(len(f) - o.cached_tokens, vocab, 300 + i)
                for i, (f, o) in enumerate(zip(follows, outs))]
    for _ in range(repeats):
        llm.engine.flush_cache()
        res["new_only_ms"].append(round(timed(llm.generate, new_only, one) * 1e3, 3))
    f, m = statistics.median(res["followup_ms"]), statistics.median(res["new_only_ms"])
    res["ratio"] = f / m
    print(f"{n} concurrent follow-ups {f:.2f} ms vs their new tokens alone {m:.2f} ms: "
          f"{f / m:.3f}x; all {res}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="'default' or a folder (else the 0.8B config)")
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--long", type=int, default=8192, help="the follow-up's cached prompt")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--skip-lengths", action="store_true")
    ap.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                    help="part 1's prompt lengths (comma-separated)")
    ap.add_argument("--skip-followup", action="store_true", help="part 1 only")
    ap.add_argument("--concurrent", type=int, default=8,
                    help="follow-up turns at once in the concurrent part (0: skip it)")
    ap.add_argument("--out", default="ttft_costs.json")
    args = ap.parse_args()
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        if args.model is None:
            path = tmp
            build_checkpoint(path, 1024, 24, args.vocab)
        else:
            path, _, args.vocab = given_checkpoint(args.model)
        llm = LLM(path, device="cuda", dtype="bfloat16", kv_memory_gb=8.0, page_size=16,
                  chunk_size=8192, max_num_batched_tokens=8192, max_running_reqs=64)
        for n in (256, 256):  # warm-up at the TTFT row's length
            llm.engine.flush_cache()
            timed(llm.generate, [prompt(n, args.vocab, 4)], one)
        res: dict = {"config": vars(args)}
        if not args.skip_lengths:
            res["lengths"] = first_costs(llm, args.vocab, one,
                                         [int(x) for x in args.lengths.split(",")])
        if not args.skip_followup:
            res["followup"] = followup(llm, args.vocab, args.long, args.repeats, one)
        if args.concurrent and not args.skip_followup:
            res["concurrent"] = concurrent_followups(llm, args.vocab, args.long,
                                                     args.concurrent, args.repeats, one)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
