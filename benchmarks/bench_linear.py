"""The gemv kernel (ops.linear.linear, M <= 32 rows) against F.linear (cuBLAS) at the 0.8B
config's decode projections (hidden 1024, bf16): GDN in_proj 1024 -> 8224, out_proj 2048 ->
1024, MLP gate_up 1024 -> 7168 and down 3584 -> 1024, attention qkv 1024 -> 5120 and o 2048 ->
1024, and the LM head 1024 -> 248320; M = 1, 2, 4, 8 rows by default (--rows: up to 32).

Timing as bench_kernels.py: CUDA events around CUDA-graph replays of a chain of `--chain` calls,
median of >= 50 replays, divided by the chain length. The calls of a chain cycle through enough
distinct copies of the weight (at least 3x the L2 cache in all, at least 2) that every call
streams its weights from HBM, as a model step does. Both paths run on the same inputs in the
same run, and their outputs are compared (max |kernel - cuBLAS| / max |cuBLAS|, a sanity
check; tests/ops/test_linear_gpu.py owns correctness). GB/s counts the bytes a call must move
(weights + x + y); %copy is that against an eager 4 GiB fp32 `b.copy_(a)` in the same run
(bytes read + written, bench_kernels.copy_bandwidth). Prints a table and writes JSON (--out).

    python benchmarks/bench_linear.py --out bench_linear.json [--rows 1,2,4,8] [--chain 32]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch
import torch.nn.functional as F
from bench_kernels import copy_bandwidth, graph_us

from deltaserve.ops import linear as linear_ops
from deltaserve.ops._ext import extension_loaded

HIDDEN, VOCAB = 1024, 248320
SHAPES = {  # name -> (N, K)
    "gdn.in_proj": (8224, HIDDEN),
    "gdn.out_proj": (HIDDEN, 2048),
    "mlp.gate_up": (7168, HIDDEN),
    "mlp.down": (HIDDEN, 3584),
    "attn.qkv": (5120, HIDDEN),
    "attn.o_proj": (HIDDEN, 2048),
    "lm_head": (VOCAB, HIDDEN),
}


def weight_copies(nbytes: int, l2_bytes: int) -> int:
    """Distinct weights a chain cycles through so that none is still in L2 when reused."""
    return max(2, min(128, math.ceil(3 * l2_bytes / nbytes)))


def bench_shape(n: int, k: int, rows: list[int], chain: int, copy: float, dtype,
                l2_bytes: int) -> dict:
    es = torch.empty((), dtype=dtype).element_size()
    copies = weight_copies(n * k * es, l2_bytes)
    weights = [torch.randn(n, k, device="cuda", dtype=dtype) / k ** 0.5 for _ in range(copies)]
    calls = max(chain, copies)
    out = {"N": n, "K": k, "weight_copies": copies, "calls_per_graph": calls, "rows": {}}
    for m in rows:
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ws = [weights[i % copies] for i in range(calls)]
        us = graph_us([(lambda w=w, x=x: linear_ops.linear(x, w)) for w in ws], calls)
        ref_us = graph_us([(lambda w=w, x=x: F.linear(x, w)) for w in ws], calls)
        y, y_ref = linear_ops.linear(x, weights[0]), F.linear(x, weights[0])
        rel = float((y.float() - y_ref.float()).abs().max() / y_ref.float().abs().max())
        nbytes = (n * k + m * k + m * n) * es
        gbps, ref_gbps = nbytes / us / 1e3, nbytes / ref_us / 1e3
        out["rows"][m] = {"us": us, "cublas_us": ref_us, "bytes": nbytes, "GBps": gbps,
                          "cublas_GBps": ref_gbps, "pct_copy": 100 * gbps / copy,
                          "cublas_pct_copy": 100 * ref_gbps / copy, "max_rel_diff": rel}
        print(f"{n:>7}{k:>6}{m:>3}{us:>9.2f}{ref_us:>10.2f}{ref_us / us:>8.2f}x"
              f"{gbps:>8.0f}{100 * gbps / copy:>7.1f}{ref_gbps:>9.0f}{100 * ref_gbps / copy:>7.1f}"
              f"{rel:>10.1e}")
    del weights
    torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,4,8")
    parser.add_argument("--chain", type=int, default=32, help="calls per graph, at least")
    parser.add_argument("--shapes", default=",".join(SHAPES), help="names from SHAPES")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    parser.add_argument("--out", default="bench_linear.json")
    args = parser.parse_args()
    assert extension_loaded(), "build deltaserve._C first (pip install -e .)"
    rows = [int(r) for r in args.rows.split(",")]
    # the kernel at every row count on every grid, whatever the engine's dispatch (ops/linear.py
    # keeps grids wider than a wave to WIDE_MAX_ROWS rows): here it is what is measured
    linear_ops.GEMV_MAX_ROWS = linear_ops.WIDE_MAX_ROWS = linear_ops.KERNEL_MAX_ROWS
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    print(f"copy {copy:.0f} GB/s; L2 {l2 >> 20} MB; {args.dtype}")
    print(f"{'N':>7}{'K':>6}{'M':>3}{'µs':>9}{'cuBLAS':>10}{'speedup':>9}{'GB/s':>8}"
          f"{'%copy':>7}{'cuB GB/s':>9}{'%copy':>7}{'rel diff':>10}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_GBps": copy, "l2_bytes": l2, "dtype": args.dtype, "shapes": {}}
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        print(name)
        results["shapes"][name] = bench_shape(n, k, rows, args.chain, copy, dtype, l2)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    gdn_layer = ("gdn.in_proj", "gdn.out_proj", "mlp.gate_up", "mlp.down")
    if all(name in results["shapes"] for name in gdn_layer):
        # the yardstick: one GDN decoder layer's four GEMMs (cuBLAS: 30.7 µs at M = 1)
        results["gdn_layer"] = {}
        for m in rows:
            us = sum(results["shapes"][name]["rows"][m]["us"] for name in gdn_layer)
            ref = sum(results["shapes"][name]["rows"][m]["cublas_us"] for name in gdn_layer)
            results["gdn_layer"][m] = {"us": us, "cublas_us": ref}
            print(f"GDN layer GEMMs, M = {m}: {us:.1f} µs (cuBLAS {ref:.1f} µs)")
    results["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
