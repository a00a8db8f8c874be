"""Paged attention kernels (decode R = 1, verify R = 4) against the ideal and the gather path.

Shapes: the 0.8B config's attention (Hq 8, Hkv 2, D 256, bf16), page size 16 (and --page-sizes
64), batches 1, 8, 32, 128, every request at context 128, 2k, 8k, 32k (its KV length after the
step's rows). Pages are handed out in a shuffled order, as a long-running pool's would be.

Timing: CUDA events around CUDA-graph replays (a chain of `--chain` calls, distinct q and
output buffers over one layer's pool), median of >= 50 replays after warm-up, divided by the
chain length. The graph is captured for max_kv_len = 40,960 (a served max_model_len), as the
engine's graphs are, so the split grid is the one the engine runs. Columns:
  kernel: ops.paged_attention (the split kernel plus its merge); with --append, the engine's
    whole decode/verify step: ops.kv_append of the rows' K/V, then the attention;
  ideal: KV bytes read (K and V of every position) / the copy bandwidth of an eager 4 GiB fp32
    `b.copy_(a)` (bytes read + written) measured in the same run (TARGETS.md);
  gather: today's prefill path run on the same rows (flat-index gather of each request's
    positions, repeat per q head, SDPA with a mask, scatter back), skipped where its gathered
    block would not fit (--gather-gb).
Writes JSON with --out.

    python benchmarks/bench_attention.py --out attn.json [--page-sizes 16,64] [--batches 1,8]
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernels import copy_bandwidth, graph_us  # the same timing as the GDN kernels

from deltaserve.engine.attention import AttentionMetadata, PagedAttentionBackend, PagedKVCache
from deltaserve.ops._ext import extension_loaded
from deltaserve.ops.attention import kv_append, paged_attention

HQ, HKV, D = 8, 2, 256
MAX_KV_LEN = 40_960


def make_pool(batch: int, ctx: int, page_size: int, gen: torch.Generator):
    """One layer's pool holding `batch` requests of `ctx` positions in shuffled pages."""
    pages_per = -(-ctx // page_size)
    num_pages = batch * pages_per + 1
    kv = PagedKVCache([0], num_pages, page_size, HKV, D, torch.bfloat16, torch.device("cuda"))
    kv.k.normal_(generator=gen)
    kv.v.normal_(generator=gen)
    order = (torch.randperm(num_pages - 1, generator=gen, device="cuda") + 1).int()
    table = order.view(batch, pages_per)
    return kv, table


def kernel_split(run, calls: int) -> dict[str, float]:
    """Device µs per call of each kernel `run` launches (eagerly, `calls` calls a run), from
    torch.profiler: how a call's time divides between the attention kernel and its merge."""
    from torch.profiler import ProfilerActivity, profile

    run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    out: dict[str, float] = {}
    for e in prof.key_averages():
        if e.device_type.name == "CUDA" and e.self_device_time_total > 0:
            name = e.key.split("<")[0].split("(")[0][-40:]
            out[name] = out.get(name, 0.0) + e.self_device_time_total / calls
    return out


def bench_case(batch: int, ctx: int, rows: int, page_size: int, chain: int, copy_gbps: float,
               gather_gb: float, gen: torch.Generator, append: bool = False,
               profile: bool = False) -> dict:
    kv, table = make_pool(batch, ctx, page_size, gen)
    lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qs = [torch.randn(batch, rows, HQ, D, device="cuda", generator=gen).bfloat16()
          for _ in range(chain)]
    outs = [None] * chain

    k_rows = torch.randn(batch * rows, HKV, D, device="cuda", generator=gen).bfloat16()

    def call(i):
        if append:  # the step's own rows: the last `rows` positions of each request
            kv_append(k_rows, k_rows, kv.k[0], kv.v[0], table, lens)
        outs[i] = paged_attention(qs[i], kv.k[0], kv.v[0], table, lens, D ** -0.5, MAX_KV_LEN)

    kernel = graph_us([lambda i=i: call(i) for i in range(chain)], chain)
    split = kernel_split(lambda: [call(i) for i in range(chain)], chain) if profile else None
    kv_bytes = batch * ctx * HKV * D * 2 * 2
    row = {"batch": batch, "ctx": ctx, "rows": rows, "page_size": page_size,
           "kernel_us": kernel, "ideal_us": kv_bytes / copy_gbps / 1e3,
           "kernel_GBps": kv_bytes / kernel / 1e3}
    row["frac_of_copy"] = row["kernel_GBps"] / copy_gbps
    if split is not None:
        row["kernels_us"] = split
    # the gather block: keys and values repeated per q head, bf16
    gathered = batch * ctx * HQ * D * 2 * 2
    row["gather_us"] = None
    if gathered <= gather_gb * 1e9:
        tables = table.tolist()
        starts = [ctx - rows] * batch
        meta = AttentionMetadata.build(tables, starts, [rows] * batch, page_size,
                                       torch.device("cuda"))
        backend = PagedAttentionBackend(kv, meta)
        k_new = torch.randn(batch * rows, HKV, D, device="cuda", generator=gen).bfloat16()
        q_flat = qs[0].view(batch * rows, HQ, D)
        row["gather_us"] = graph_us([lambda: backend.forward(0, q_flat, k_new, k_new)], 1)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench_attention.json")
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--contexts", default="128,2048,8192,32768")
    ap.add_argument("--rows", default="1,4")
    ap.add_argument("--page-sizes", default="16,64")
    ap.add_argument("--chain", type=int, default=8)
    ap.add_argument("--gather-gb", type=float, default=24.0)
    ap.add_argument("--append", action="store_true", help="time kv_append + attention")
    ap.add_argument("--profile", action="store_true",
                    help="also each kernel's device time per call (eager, torch.profiler)")
    args = ap.parse_args()
    assert extension_loaded(), "deltaserve._C is not built: nothing to measure"
    gen = torch.Generator(device="cuda").manual_seed(0)
    copy_gbps = copy_bandwidth()
    results = []
    print(f"copy bandwidth {copy_gbps:.0f} GB/s; max_kv_len {MAX_KV_LEN}")
    print(f"{'ps':>4s} {'B':>4s} {'ctx':>6s} {'R':>2s} {'kernel us':>10s} {'ideal us':>9s} "
          f"{'% copy':>7s} {'gather us':>10s} {'verify/decode':>14s}")
    for ps in (int(x) for x in args.page_sizes.split(",")):
        for b in (int(x) for x in args.batches.split(",")):
            for ctx in (int(x) for x in args.contexts.split(",")):
                decode_us = None
                for rows in (int(x) for x in args.rows.split(",")):
                    row = bench_case(b, ctx, rows, ps, args.chain, copy_gbps, args.gather_gb,
                                     gen, args.append, args.profile)
                    torch.cuda.empty_cache()  # this case's pool and graphs are gone
                    if rows == 1:
                        decode_us = row["kernel_us"]
                    elif decode_us is not None:
                        row["vs_decode"] = row["kernel_us"] / decode_us
                    results.append(row)
                    gather = "-" if row["gather_us"] is None else f"{row['gather_us']:.1f}"
                    ratio = f"{row['vs_decode']:.2f}" if "vs_decode" in row else ""
                    print(f"{ps:4d} {b:4d} {ctx:6d} {rows:2d} {row['kernel_us']:10.2f} "
                          f"{row['ideal_us']:9.2f} {100 * row['frac_of_copy']:6.1f}% "
                          f"{gather:>10s} {ratio:>14s}", flush=True)
                    if "kernels_us" in row:
                        print("      " + ", ".join(f"{k} {v:.2f} us"
                                                   for k, v in row["kernels_us"].items()))
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "copy_GBps": copy_gbps, "max_kv_len": MAX_KV_LEN,
                   "device": torch.cuda.get_device_name(), "rows": results}, f, indent=2)


if __name__ == "__main__":
    main()
