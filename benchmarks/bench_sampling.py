"""Batched sampler (deltaserve/engine/sampling.py) at vocab 248,320, batch 1 / 32 / 128.

Per parameter mix: device time of `sample` (CUDA events around a CUDA graph of `--chain`
calls, median of >= 50 replays, divided by the chain: the sampler has no host sync, so it
captures), eager wall time of `sample` (launch-bound at small batch: what a step without a
graph pays), and host time of `SamplingTensors.build` (per step, off the GPU's critical path
with overlap scheduling). Ideal: one read of the fp32 logits at the copy bandwidth of an eager
4 GiB fp32 copy in the same run. Prints a table and writes JSON (--out).

    python benchmarks/bench_sampling.py --out bench_sampling.json [--batch 1,32,128]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from bench_kernels import copy_bandwidth, graph_us, median_ms

from deltaserve.core import SamplingParams
from deltaserve.engine.sampling import SamplingRow, SamplingTensors, sample

VOCAB = 248_320
MIXES = {  # name -> params of every row (penalty rows: a 512-token prompt, 128 outputs)
    "greedy": SamplingParams(temperature=0.0),
    "temperature": SamplingParams(temperature=0.8),
    "top_k": SamplingParams(temperature=0.8, top_k=50),
    "top_p": SamplingParams(temperature=0.8, top_p=0.9),
    "top_k_p_min_p": SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05),
    "penalties": SamplingParams(temperature=0.8, top_p=0.9, repetition_penalty=1.1,
                                presence_penalty=0.5, frequency_penalty=0.2),
}


def rows_for(params: SamplingParams, batch: int, rng: random.Random) -> list[SamplingRow]:
    ids = lambda n: [rng.randrange(VOCAB) for _ in range(n)]  # noqa: E731
    return [SamplingRow(params, ids(512), ids(128), seed) for seed in range(batch)]


def bench(batch: int, name: str, chain: int) -> dict:
    rng = random.Random(batch)
    rows = rows_for(MIXES[name], batch, rng)
    logits = torch.randn(batch, VOCAB, device="cuda") * 3
    t0 = time.perf_counter()
    for _ in range(20):
        st = SamplingTensors.build(rows, VOCAB, logits.device)
    build_us = (time.perf_counter() - t0) / 20 * 1e6
    torch.cuda.synchronize()
    eager_us = median_ms(lambda: sample(logits, st)) * 1e3
    try:
        device_us = graph_us([lambda: sample(logits, st)] * chain, chain)
    except RuntimeError as e:  # report, and keep benchmarking the other mixes
        print(f"  {name} at batch {batch}: graph capture failed ({e}); device_us = nan")
        device_us = float("nan")
    return {"batch": batch, "mix": name, "device_us": device_us, "eager_us": eager_us,
            "build_us": build_us, "logits_bytes": batch * VOCAB * 4}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", default="1,32,128")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    bw = copy_bandwidth()
    results = []
    print(f"copy bandwidth {bw:.0f} GB/s; vocab {VOCAB}")
    print(f"{'batch':>5} {'mix':<14} {'device us':>10} {'eager us':>9} {'build us':>9} "
          f"{'ideal us':>9}")
    for b in (int(x) for x in args.batch.split(",")):
        for name in MIXES:
            r = bench(b, name, args.chain)
            r["ideal_us"] = r["logits_bytes"] / bw / 1e3  # the logits read once, at copy GB/s
            results.append(r)
            print(f"{b:>5} {name:<14} {r['device_us']:>10.1f} {r['eager_us']:>9.1f} "
                  f"{r['build_us']:>9.1f} {r['ideal_us']:>9.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"copy_gbps": bw, "vocab": VOCAB, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
