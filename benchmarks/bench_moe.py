"""One MoE layer (router GEMM, routing, experts, shared expert, combine: `SparseMoE.forward`) on
the GPU at Qwen3.6-35B-A3B shapes (256 experts top-8, hidden 2048, expert and shared width 512),
bf16, inside a CUDA graph, on its two paths:
- fused: the extension's kernels (ops/moe_fused.py: moe_route + moe_experts), T <= 256;
- grouped: route + shared MLP + torch._grouped_mm (ops/moe.py), forced by FUSED_MAX_TOKENS = 0;
each beside the weight-read ideal of the call (router + shared expert + the distinct experts
its tokens selected, ÷ 4,274 GB/s copy bandwidth). The weights stream from HBM as in a model
step: the graph runs --calls layers in a row, cycling over --copies independent layers (6.4 GB
of experts for 4), each call with its own tokens, so no call finds its experts in L2. Also the
kernels one eager call launches (torch.profiler). Prints a table and writes JSON; ~30 s.

    python benchmarks/bench_moe.py --out moe.json
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
from transformers import Qwen3_5MoeTextConfig

from deltaserve.model.config import ModelConfig
from deltaserve.model.mlp import SparseMoE
from deltaserve.ops import moe_fused

E, K, H, I = 256, 8, 2048, 512
COPY_GBS = 4274.0
EXPERT_BYTES = 3 * H * I * 2
FIXED_BYTES = ((E + 1) * H + 3 * H * I) * 2  # router | shared gate, shared expert


def make_layers(copies: int) -> list[SparseMoE]:
    # transformers' Qwen3_5MoeTextConfig defaults: Qwen3.5/3.6-35B-A3B's shapes
    config = ModelConfig.from_dict(Qwen3_5MoeTextConfig(num_hidden_layers=1).to_dict())
    layers, default = [], torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"), torch.no_grad():
            for _ in range(copies):
                layer = SparseMoE(config).requires_grad_(False)
                for p in layer.parameters():
                    p.normal_(0.0, p.shape[-1] ** -0.5)
                layers.append(layer)
    finally:
        torch.set_default_dtype(default)
    return layers


def graph_time_us(calls, reps: int) -> float:
    """Median µs per call of a CUDA graph that runs every fn in `calls` once (after warm-up)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(calls))
    return statistics.median(times)


def kernels_per_call(fn) -> int:
    """CUDA kernels (and memsets/copies) one eager call launches."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def distinct_experts(layer: SparseMoE, x: torch.Tensor) -> int:
    _, idx = moe_fused.route_fused_reference(layer.router(x), E, K, True)
    return int(torch.unique(idx).numel())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256, 1024])
    ap.add_argument("--copies", type=int, default=4, help="independent layers cycled through")
    ap.add_argument("--calls", type=int, default=8, help="layer calls in one graph replay")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="moe.json")
    args = ap.parse_args()
    layers = make_layers(args.copies)
    fused_max = moe_fused.FUSED_MAX_TOKENS
    rows = []
    for t in args.tokens:
        gen = torch.Generator(device="cuda").manual_seed(t)
        xs = [torch.randn(t, H, device="cuda", generator=gen).bfloat16()
              for _ in range(args.calls)]
        calls = [lambda i=i, xs=xs: layers[i % len(layers)](xs[i]) for i in range(args.calls)]
        with torch.no_grad():
            chosen = statistics.mean(distinct_experts(layers[i % len(layers)], xs[i])
                                     for i in range(args.calls))
            read = FIXED_BYTES + chosen * EXPERT_BYTES
            row = {"tokens": t, "distinct_experts": chosen, "read_mb": read / 1e6,
                   "ideal_us": read / (COPY_GBS * 1e3)}
            paths = [("fused", fused_max)] if t <= fused_max else []
            for name, limit in paths + [("grouped", 0)]:
                moe_fused.FUSED_MAX_TOKENS = limit
                try:
                    row[f"{name}_us"] = graph_time_us(calls, args.reps)
                    row[f"{name}_kernels"] = kernels_per_call(calls[0])
                finally:
                    moe_fused.FUSED_MAX_TOKENS = fused_max
                row[f"{name}_x_ideal"] = row[f"{name}_us"] / row["ideal_us"]
        rows.append(row)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in row.items()), flush=True)
    with open(args.out, "w") as f:
        json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
