"""Kernel microbenchmarks at the TARGETS.md shapes (Qwen3-Next GDN: H=16, HV=32, K=V=128,
conv_dim 8192, W=4, fp32 state, bf16 activations), batches 1..512.

Timing: CUDA events around CUDA-graph replays of a chain of calls on distinct layers (the way a
model step runs them), median of >= 50 replays after warm-up, divided by the chain length.
Reference bandwidth: an eager 4 GiB fp32 `copy_` timed with events in the same run. Anchors in
the same run: fla-core `fused_recurrent_gated_delta_rule` (decode, T=1, and T=R for verify) and
fla-core `causal_conv1d_update`; torch's in-place `mul_` of the state bytes gdn_decode reads and
writes (the floor of a plain read-modify-write in this chained form). gdn_replay_verify is
gdn_verify with the previous step's R rows pending (gdn_replay of that layer folded into the
verify launch). Prints a table and writes JSON (--out).

    python benchmarks/bench_kernels.py --out results.json [--batches 1,8,64] [--rows 4]
    python benchmarks/bench_kernels.py --gdn-rows 1,2,4   # also each forced rows-per-thread
    python benchmarks/bench_kernels.py --gdn-tiles 1,2,4,8   # also each forced tiles/block
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

from deltaserve import ops
from deltaserve.ops._ext import extension_loaded

H, HV, K, V, D, W = 16, 32, 128, 128, 8192, 4
STATE_BYTES = HV * V * K * 4  # one request, one layer
GRAPH_BUDGET = 24 << 30  # bytes of state pools per chained graph


def median_ms(fn, reps: int = 50, warmup: int = 5) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_us(calls, chain: int, reps: int = 60) -> float:
    """µs per call: one graph holding `calls` (a list of closures), replayed `reps` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls:  # warm-up outside capture (Triton JIT, allocator)
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    return median_ms(graph.replay, reps) * 1e3 / chain


def copy_bandwidth() -> float:
    """GB/s (bytes read + written) of an eager 4 GiB fp32 device copy."""
    a = torch.empty(1 << 30, dtype=torch.float32, device="cuda")
    b = torch.empty_like(a)
    ms = median_ms(lambda: b.copy_(a), reps=10, warmup=2)
    return 2 * (4 << 30) / ms / 1e6


def host_bandwidth() -> tuple[float, float]:
    """GB/s device->pinned host and pinned host->device for 1 GiB."""
    d = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    h = torch.empty(d.shape, dtype=torch.float32, pin_memory=True)
    d2h = median_ms(lambda: h.copy_(d, non_blocking=True), reps=5, warmup=1)
    h2d = median_ms(lambda: d.copy_(h, non_blocking=True), reps=5, warmup=1)
    return (1 << 30) / d2h / 1e6, (1 << 30) / h2d / 1e6


def gdn_inputs(chain, n, rows=None):
    lead = (chain, n) if rows is None else (chain, n, rows)
    r = lambda *s: torch.randn(*lead, *s, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    A_log = torch.log(torch.rand(HV, device="cuda") * 15 + 1)
    return r(H, K), r(H, K), r(HV, V), r(HV), r(HV), A_log, torch.randn(HV, device="cuda")


def bench_gdn(n: int, rows: int, only: tuple[str, ...] | None = None) -> dict:
    """µs per call of each GDN op at batch n (verify with `rows` rows), and the bytes each moves.
    `only`: just gdn_decode when it names no other GDN op (A/B runs of decode); any of
    gdn_verify, gdn_replay or gdn_replay_verify times all of the rest (replay reads the stash
    verify writes)."""
    want = lambda op: only is None or op in only  # noqa: E731
    chain = max(1, min(32, GRAPH_BUDGET // ((n + 1) * STATE_BYTES)))
    pool = torch.randn(chain, n + 1, HV, V, K, device="cuda").mul_(0.1)
    slots = (torch.randperm(n, device="cuda") + 1).int()
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(chain, n)
    scale = K ** -0.5
    out = {"chain": chain}
    if want("gdn_decode"):
        out["gdn_decode"] = graph_us([
            (lambda i=i: ops.gdn_decode(q[i], k[i], v[i], a[i], b[i], A_log, dt_bias, pool[i],
                                        slots, scale)) for i in range(chain)], chain)
    if only is not None and not {"gdn_verify", "gdn_replay", "gdn_replay_verify"} & set(only):
        return out
    qr, kr, vr, ar, br, _, _ = gdn_inputs(chain, n, rows)
    stash = ops.GDNStash.allocate(chain, n, rows, H, HV, K, V, "cuda")
    out["gdn_verify"] = graph_us([
        (lambda i=i: ops.gdn_verify(qr[i], kr[i], vr[i], ar[i], br[i], A_log, dt_bias, pool[i],
                                    slots, scale, stash, i)) for i in range(chain)], chain)
    accepted = torch.full((n,), rows, dtype=torch.int32, device="cuda")
    out["gdn_replay"] = graph_us([lambda: ops.gdn_replay(stash, pool, slots, accepted)], chain)
    # anchor: torch's in-place read-modify-write of the state bytes decode moves (slots 1..n)
    out["inplace_mul"] = graph_us([(lambda i=i: pool[i, 1:].mul_(1.0)) for i in range(chain)],
                                  chain)
    # verify with the previous step's rows pending (all `rows` accepted): replay folded in
    stash2 = ops.GDNStash.allocate(chain, n, rows, H, HV, K, V, "cuda")
    out["gdn_replay_verify"] = graph_us([
        (lambda i=i: ops.gdn_verify(qr[i], kr[i], vr[i], ar[i], br[i], A_log, dt_bias, pool[i],
                                    slots, scale, stash2, i, pending=(stash, accepted)))
        for i in range(chain)], chain)
    stash_row = (H * K + HV * V + 2 * HV) * 4
    io = (2 * H * K + HV * V + 2 * HV) * 2 + HV * V * 2  # q, k, v, a, b in; o out (bf16)
    out["bytes"] = {"gdn_decode": n * (2 * STATE_BYTES + io),
                    "gdn_verify": n * (STATE_BYTES + rows * (io + stash_row)),
                    "gdn_replay": n * (2 * STATE_BYTES + rows * stash_row),
                    "gdn_replay_verify": n * (2 * STATE_BYTES + rows * (io + 2 * stash_row))}
    return out


def bench_fla(n: int, rows: int) -> dict:
    """fla-core fused_recurrent on the same work (dense state batch, gates fused in-kernel)."""
    from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule

    chain = max(1, min(32, GRAPH_BUDGET // (2 * n * STATE_BYTES)))
    state = torch.randn(chain, n, HV, V, K, device="cuda").mul_(0.1)
    res = {}
    for name, t in (("fla_decode", 1), ("fla_verify_T", rows)):
        q, k, v, a, b, A_log, dt_bias = gdn_inputs(chain, n, t)

        def call(i, q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias):
            fused_recurrent_gated_delta_rule(
                q[i], k[i], v[i], g=a[i], beta=b[i], scale=K ** -0.5, initial_state=state[i],
                output_final_state=True, use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                A_log=A_log, dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True,
                state_v_first=True)
        res[name] = graph_us([(lambda i=i: call(i)) for i in range(chain)], chain)
    return res


def bench_conv(n: int, rows: int) -> dict:
    chain = 32
    x1 = torch.randn(chain, n, D, device="cuda", dtype=torch.bfloat16)
    xr = torch.randn(chain, n, rows, D, device="cuda", dtype=torch.bfloat16)
    weight = torch.randn(D, W, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(D, device="cuda", dtype=torch.bfloat16)
    state = torch.randn(chain, n + 1, W - 1, D, device="cuda", dtype=torch.bfloat16)
    slots = (torch.randperm(n, device="cuda") + 1).int()
    accepted = torch.full((n,), rows, dtype=torch.int32, device="cuda")
    out = {
        "conv_update": graph_us([(lambda i=i: ops.causal_conv1d_update(
            x1[i], weight, bias, state[i], slots)) for i in range(chain)], chain),
        "conv_verify": graph_us([(lambda i=i: ops.causal_conv1d_verify(
            xr[i], weight, bias, state[i], slots)) for i in range(chain)], chain),
        "conv_commit": graph_us([(lambda i=i: ops.causal_conv1d_commit(
            xr[i], state[i], slots, accepted)) for i in range(chain)], chain),
    }
    win = (W - 1) * D * 2
    out["bytes"] = {"conv_update": n * (2 * win + 2 * D * 2),
                    "conv_verify": n * (win + 2 * rows * D * 2),
                    "conv_commit": n * (win + rows * D * 2)}
    try:
        from fla.modules.causal_conv1d import causal_conv1d_update as fla_update

        cache = torch.randn(chain, n, D, W, device="cuda", dtype=torch.bfloat16)
        out["fla_conv_update"] = graph_us([(lambda i=i: fla_update(
            x1[i], cache[i], weight=weight, bias=bias, activation="silu")) for i in range(chain)],
            chain)
    except Exception as exc:  # an anchor failing must not stop our own figures
        out["fla_conv_update_error"] = repr(exc)[:200]
    return out


def bench_snapshot(n_slots: int, layers: int = 48) -> dict:
    rec = torch.randn(layers, 2 * n_slots + 1, HV, V, K, device="cuda")
    conv = torch.randn(layers, 2 * n_slots + 1, W - 1, D, device="cuda", dtype=torch.bfloat16)
    host = (torch.empty(layers, n_slots, HV, V, K, pin_memory=True),
            torch.empty(layers, n_slots, W - 1, D, dtype=torch.bfloat16, pin_memory=True))
    src, dst = list(range(1, n_slots + 1)), list(range(n_slots + 1, 2 * n_slots + 1))
    per_slot = layers * (STATE_BYTES + (W - 1) * D * 2)
    d2d = median_ms(lambda: ops.snapshot_copy((rec, conv), src, (rec, conv), dst), 10)
    # the same copy 5 times back to back: the host's time to enqueue the first call (which a
    # single timed call waits on: about 10% at this size) is amortized over 5
    d2d_5 = median_ms(lambda: [ops.snapshot_copy((rec, conv), src, (rec, conv), dst)
                               for _ in range(5)], 10) / 5
    d2h = median_ms(lambda: ops.snapshot_copy((rec, conv), src, host, list(range(n_slots))), 5)
    h2d = median_ms(lambda: ops.snapshot_copy(host, list(range(n_slots)), (rec, conv), dst), 5)
    return {"slots": n_slots, "layers": layers, "bytes": n_slots * per_slot,
            "d2d_GBps": 2 * n_slots * per_slot / d2d / 1e6,  # read + write
            "d2d_back_to_back_GBps": 2 * n_slots * per_slot / d2d_5 / 1e6,
            "d2h_GBps": n_slots * per_slot / d2h / 1e6, "h2d_GBps": n_slots * per_slot / h2d / 1e6}


def forced(n: int, rows: int, var: str, choices: str, label: str) -> dict:
    """bench_gdn with the environment variable `var` (DS_GDN_ROWS or DS_GDN_TILES, read by the
    extension at every launch, hence at graph capture) forced to each of `choices`."""
    res = {}
    for r in [int(x) for x in choices.split(",") if x]:
        os.environ[var] = str(r)
        try:
            t = bench_gdn(n, rows)
        finally:
            del os.environ[var]
        res[r] = {op: t[op] for op in ("gdn_decode", "gdn_verify", "gdn_replay",
                                       "gdn_replay_verify")}
        print(f"  {label} {r}: " + ", ".join(f"{op} {us:.2f}" for op, us in res[r].items()))
        torch.cuda.empty_cache()
    return res


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", default="1,8,32,64,128,256,512")
    parser.add_argument("--rows", type=int, default=4, help="verify rows (k + 1)")
    parser.add_argument("--fla-max-batch", type=int, default=96,
                        help="fla-core fused_recurrent crashes at B >= 128 (TARGETS.md)")
    parser.add_argument("--gdn-rows", default="",
                        help="also time the GDN ops with DS_GDN_ROWS forced to each of these")
    parser.add_argument("--gdn-tiles", default="",
                        help="also time the GDN ops with DS_GDN_TILES (tiles per block) "
                             "forced to each of these")
    parser.add_argument("--out", default="bench_kernels.json")
    args = parser.parse_args()
    assert extension_loaded(), "build deltaserve._C first (pip install -e .)"
    t0 = time.time()
    copy = copy_bandwidth()
    torch.cuda.empty_cache()
    d2h_link, h2d_link = host_bandwidth()
    print(f"copy {copy:.0f} GB/s; pinned host link d2h {d2h_link:.1f} h2d {h2d_link:.1f} GB/s")
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "copy_GBps": copy, "host_d2h_GBps": d2h_link, "host_h2d_GBps": h2d_link,
               "rows": args.rows, "batches": {}}
    header = f"{'op':<16}{'B':>5}{'µs':>10}{'GB/s':>9}{'%copy':>7}{'ideal µs':>10}{'fla µs':>9}"
    print(header)
    for n in [int(x) for x in args.batches.split(",")]:
        row = bench_gdn(n, args.rows)
        conv = bench_conv(n, args.rows)
        row["bytes"].update(conv.pop("bytes"))
        row.update(conv)
        if n <= args.fla_max_batch:
            try:
                row.update(bench_fla(n, args.rows))
            except Exception as exc:
                row["fla_error"] = repr(exc)[:200]
        anchors = {"gdn_decode": "fla_decode", "gdn_verify": "fla_verify_T",
                   "conv_update": "fla_conv_update"}
        for op in ("gdn_decode", "gdn_verify", "gdn_replay", "gdn_replay_verify", "conv_update",
                   "conv_verify", "conv_commit"):
            nbytes = row["bytes"][op] if op in row["bytes"] else 0
            us = row[op]
            gbps = nbytes / us / 1e3
            fla = row.get(anchors.get(op, ""), float("nan"))
            print(f"{op:<16}{n:>5}{us:>10.2f}{gbps:>9.0f}{100 * gbps / copy:>7.1f}"
                  f"{nbytes / copy / 1e3:>10.2f}{fla:>9.2f}")
        row["verify_plus_replay_over_decode"] = (row["gdn_verify"] + row["gdn_replay"]) / \
            row["gdn_decode"]
        row["replay_verify_over_decode"] = row["gdn_replay_verify"] / row["gdn_decode"]
        print(f"  torch in-place mul_ of decode's state bytes: {row['inplace_mul']:.2f} µs")
        print(f"  verify+replay / decode = {row['verify_plus_replay_over_decode']:.2f}; "
              f"replay_verify (one launch) / decode = {row['replay_verify_over_decode']:.2f}")
        row["forced_rows"] = forced(n, args.rows, "DS_GDN_ROWS", args.gdn_rows, "rows/thread")
        row["forced_tiles"] = forced(n, args.rows, "DS_GDN_TILES", args.gdn_tiles,
                                     "tiles/block")
        results["batches"][n] = row
        torch.cuda.empty_cache()  # the pools of this batch size are unreachable now
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    torch.cuda.empty_cache()
    results["snapshot"] = bench_snapshot(8)
    s = results["snapshot"]
    print(f"snapshot_copy {s['slots']} slots x {s['layers']} layers: d2d {s['d2d_GBps']:.0f} GB/s "
          f"({100 * s['d2d_GBps'] / copy:.0f}% of copy; back to back "
          f"{s['d2d_back_to_back_GBps']:.0f}, {100 * s['d2d_back_to_back_GBps'] / copy:.0f}%), "
          f"d2h {s['d2h_GBps']:.1f} "
          f"({100 * s['d2h_GBps'] / d2h_link:.0f}% of link), h2d {s['h2d_GBps']:.1f} GB/s "
          f"({100 * s['h2d_GBps'] / h2d_link:.0f}% of link)")
    results["seconds"] = time.time() - t0
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
