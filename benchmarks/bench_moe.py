"""One MoE block (router, top-k, experts, shared expert, combine) on the GPU, Qwen3.6-35B-A3B
shapes (256 experts top-8, hidden 2048, expert and shared width 512), bf16, inside a CUDA graph.

For each token count T: the grouped form (torch._grouped_mm) and, for T ≤ 64, the gathered form
(batched GEMVs over gathered weight slices), each beside the weight-read roofline of the block
(router + shared expert + the distinct experts the T tokens selected, ÷ 4,274 GB/s). Prints a
table and writes JSON.

    python benchmarks/bench_moe.py --out moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from deltaserve.ops import moe
from deltaserve.ops.fused import silu_mul

E, K, H, I = 256, 8, 2048, 512
COPY_GBS = 4274.0


def graph_time_us(fn, reps: int = 50) -> float:
    """Median µs of one replay of a CUDA graph that runs fn() 10 times (after warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / 10)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 256, 4096])
    ap.add_argument("--out", default="moe.json")
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    assert moe.grouped_is_graph_safe(dev, dt), "no sync-free torch._grouped_mm on this GPU"
    gen = torch.Generator(device=dev).manual_seed(0)
    gate_up = torch.randn(E, 2 * I, H, device=dev, generator=gen).to(dt) * H ** -0.5
    down = torch.randn(E, H, I, device=dev, generator=gen).to(dt) * I ** -0.5
    router = torch.randn(E, H, device=dev, generator=gen).to(dt) * H ** -0.5
    shared_gu = torch.randn(2 * I, H, device=dev, generator=gen).to(dt) * H ** -0.5
    shared_down = torch.randn(H, I, device=dev, generator=gen).to(dt) * I ** -0.5
    shared_gate = torch.randn(1, H, device=dev, generator=gen).to(dt) * H ** -0.5
    expert_bytes = 3 * H * I * 2
    rows = []
    for t in args.tokens:
        x = torch.randn(t, H, device=dev, generator=gen).to(dt)

        def block(experts, x=x):
            w, idx = moe.route(x @ router.T, K, norm_topk_prob=True)
            shared = silu_mul(x @ shared_gu.T) @ shared_down.T
            return experts(x, gate_up, down, idx, w, shared, x @ shared_gate.T)

        _, idx = moe.route(x @ router.T, K, norm_topk_prob=True)
        chosen = int(torch.unique(idx).numel())
        read = (E * H + 3 * H * I + H) * 2 + chosen * expert_bytes
        row = {"tokens": t, "distinct_experts": chosen, "read_mb": read / 1e6,
               "roofline_us": read / (COPY_GBS * 1e3),
               "grouped_us": graph_time_us(lambda: block(moe.experts_grouped))}
        if t <= 64:
            row["gathered_us"] = graph_time_us(lambda: block(moe.experts_gathered))
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
