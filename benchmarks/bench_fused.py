"""Fused norm / gate kernels (deltaserve/ops/fused.py) at the 0.8B config's shapes (hidden 1024;
GDN 16 value heads of 128 with z inside the 8224-wide merged projection; attention 8 q / 2 kv
heads of 256, rot 64; MLP intermediate 3584), bf16, T = 1, 32, 8192 tokens.

Timing as bench_kernels.py: CUDA events around CUDA-graph replays of a chain of `--chain` calls
on distinct inputs, median of >= 50 replays, divided by the chain length; the pure-torch
reference (the unfused path it replaces) timed the same way. Ideal: the op's bytes moved (read
+ written) at the copy bandwidth of an eager 4 GiB fp32 `b.copy_(a)` in the same run
(TARGETS.md). Prints a table and writes JSON (--out).

    python benchmarks/bench_fused.py --out bench_fused.json [--tokens 1,32,8192] [--chain 32]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from bench_kernels import copy_bandwidth, graph_us

from deltaserve.ops import fused
from deltaserve.ops._ext import extension_loaded

HIDDEN, HV, V, HQ, HKV, HEAD, ROT, INTER = 1024, 16, 128, 8, 2, 256, 64, 3584
GDN_PROJ = 4 * HV * V + 2 * HV  # 8224: q | k | v | z | b | a
ATTN_PROJ = 2 * HQ * HEAD + 2 * HKV * HEAD  # q+gate | k | v
EPS = 1e-6


def op_cases(t: int, dtype) -> dict[str, tuple]:
    """name -> (make_args() -> a fresh set of inputs, kernel, reference, bytes moved)."""
    es = torch.empty((), dtype=dtype).element_size()

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, device="cuda", dtype=dt)

    def w(n, dt=torch.float32):
        return 1 + 0.1 * rnd(n, dt=dt)

    def attn():
        proj = rnd(t, ATTN_PROJ)
        return (proj[:, :2 * HQ * HEAD].view(t, HQ, 2 * HEAD),
                proj[:, 2 * HQ * HEAD:(2 * HQ + HKV) * HEAD].view(t, HKV, HEAD))

    def gdn():
        return rnd(t, HV, V), rnd(t, GDN_PROJ)[:, 3 * HV * V:4 * HV * V].view(t, HV, V)

    def qk():
        q_gate, k = attn()
        return q_gate, k, w(HEAD), w(HEAD), rnd(t, ROT), rnd(t, ROT), EPS

    return {
        "rms_norm": (lambda: (rnd(t, HIDDEN), w(HIDDEN), EPS), fused.rms_norm,
                     fused.rms_norm_ref, 2 * t * HIDDEN * es),
        "add_rms_norm": (lambda: (rnd(t, HIDDEN), rnd(t, HIDDEN), w(HIDDEN), EPS),
                         fused.add_rms_norm, fused.add_rms_norm_ref, 4 * t * HIDDEN * es),
        "gated_rms_norm": (lambda: (*gdn(), w(V, dtype), EPS), fused.gated_rms_norm,
                           fused.gated_rms_norm_ref, 3 * t * HV * V * es),
        "qk_norm_rope": (qk, fused.qk_norm_rope, fused.qk_norm_rope_ref,
                         (2 * (HQ + HKV) * HEAD + 2 * ROT) * t * es),
        "sigmoid_gate_mul": (lambda: (rnd(t, HQ, HEAD), attn()[0]), fused.sigmoid_gate_mul,
                             fused.sigmoid_gate_mul_ref, 3 * t * HQ * HEAD * es),
        "silu_mul": (lambda: (rnd(t, 2 * INTER),), fused.silu_mul, fused.silu_mul_ref,
                     3 * t * INTER * es),
    }


def bench(t: int, dtype, chain: int, copy: float) -> dict:
    out = {}
    for name, (make, kernel, ref, nbytes) in op_cases(t, dtype).items():
        args = [make() for _ in range(chain)]
        us = graph_us([(lambda a=a, f=kernel: f(*a)) for a in args], chain)
        ref_us = graph_us([(lambda a=a, f=ref: f(*a)) for a in args], chain)
        ideal = nbytes / copy / 1e3
        out[name] = {"us": us, "ref_us": ref_us, "bytes": nbytes, "ideal_us": ideal,
                     "pct_copy": 100 * ideal / us}
        print(f"{name:<18}{t:>6}{us:>9.2f}{ref_us:>10.2f}{ref_us / us:>8.1f}x"
              f"{ideal:>10.2f}{100 * ideal / us:>7.1f}")
        del args
        torch.cuda.empty_cache()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="1,32,8192")
    parser.add_argument("--chain", type=int, default=32, help="calls per graph (distinct inputs)")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--out", default="bench_fused.json")
    args = parser.parse_args()
    assert extension_loaded(), "build deltaserve._C first (pip install -e .)"
    dtype = getattr(torch, args.dtype)
    t0 = time.time()
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    print(f"copy {copy:.0f} GB/s; {args.dtype}, {args.chain} chained calls per graph")
    print(f"{'op':<18}{'T':>6}{'µs':>9}{'ref µs':>10}{'speedup':>9}{'ideal µs':>10}{'%copy':>7}")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_GBps": copy, "dtype": args.dtype, "chain": args.chain, "tokens": {}}
    for t in [int(x) for x in args.tokens.split(",")]:
        results["tokens"][t] = bench(t, dtype, args.chain, copy)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    results["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
