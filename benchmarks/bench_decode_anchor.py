"""gdn_decode and gdn_verify beside torch's in-place `mul_` of the same state bytes, chained.

The anchor is the floor a memory-bound read-modify-write of those bytes reaches in the same
chained-graph form (bench_kernels.graph_us): at B=1 and B=8 it shows how much of decode's time
is the launch and the memory system rather than the kernel. Prints one JSON line per batch and
writes all of them to $OUT/bench_decode_anchor.json (or ./).

    BS=1,8,32,64,256 python benchmarks/bench_decode_anchor.py
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import bench_kernels as bk  # noqa: E402

from deltaserve import ops  # noqa: E402

H, HV, K, V = bk.H, bk.HV, bk.K, bk.V


def one(n: int, rows: int = 4) -> dict:
    """µs per call of decode, verify (R=rows) and the anchor at batch n."""
    chain = max(1, min(32, bk.GRAPH_BUDGET // ((n + 1) * bk.STATE_BYTES)))
    pool = torch.randn(chain, n + 1, HV, V, K, device="cuda").mul_(0.1)
    slots = (torch.randperm(n, device="cuda") + 1).int()
    q, k, v, a, b, A_log, dt_bias = bk.gdn_inputs(chain, n)
    qr, kr, vr, ar, br, _, _ = bk.gdn_inputs(chain, n, rows)
    stash = ops.GDNStash.allocate(chain, n, rows, H, HV, K, V, "cuda")
    sc = K ** -0.5
    x = pool[:, 1:]  # the slots decode touches (slots is a permutation of 1..n)
    return {
        "decode": round(bk.graph_us([(lambda i=i: ops.gdn_decode(
            q[i], k[i], v[i], a[i], b[i], A_log, dt_bias, pool[i], slots, sc))
            for i in range(chain)], chain), 2),
        "verify": round(bk.graph_us([(lambda i=i: ops.gdn_verify(
            qr[i], kr[i], vr[i], ar[i], br[i], A_log, dt_bias, pool[i], slots, sc, stash, i))
            for i in range(chain)], chain), 2),
        "torch_mul_": round(bk.graph_us([(lambda i=i: x[i].mul_(1.0)) for i in range(chain)],
                                     chain), 2),
    }


def main() -> None:
    out = {"copy_GBps": bk.copy_bandwidth()}
    print("copy", out["copy_GBps"])
    for n in [int(x) for x in os.environ.get("BS", "1,8,64").split(",")]:
        out[n] = one(n)
        print(n, json.dumps(out[n]), flush=True)
        torch.cuda.empty_cache()
    with open(os.path.join(os.environ.get("OUT", "."), "bench_decode_anchor.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
