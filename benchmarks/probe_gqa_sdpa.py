"""Prefill attention with grouped kv heads (`enable_gqa`) against kv heads repeated to the q
heads first, the two ways `engine/prefill_attention._causal` has attended on CUDA (the repeat
until session 41), on the 0.8B config's attention shapes (8 q / 2 kv heads x 256, bf16).

Shapes: an 8,192-token prompt (`is_causal`), and a follow-up turn of 288 new rows over 8,480
positions (`causal_lower_right`). Each is timed with CUDA events, median of --iters calls after
warm-up (bench_kernels.median_ms), in one process, so the two arms share the machine.

    python benchmarks/probe_gqa_sdpa.py --out gqa_sdpa.json
"""

from __future__ import annotations

import argparse
import json

import torch
from bench_kernels import median_ms  # a sibling script
from torch.nn.attention.bias import causal_lower_right

from deltaserve.engine.prefill_attention import _sdpa


def arms(rows: int, length: int, iters: int, hq: int = 8, hkv: int = 2,
         d: int = 256) -> dict:
    """ms per call of each arm, q [rows, hq, d] at the last rows of length positions."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    q = torch.randn(rows, hq, d, device=dev, dtype=dt)
    k = torch.randn(length, hkv, d, device=dev, dtype=dt)
    v = torch.randn(length, hkv, d, device=dev, dtype=dt)
    kw = {"is_causal": True} if rows == length else {"attn_mask": causal_lower_right(rows, length)}
    qh = q.transpose(0, 1)[None]

    def gqa():
        return _sdpa(qh, k.transpose(0, 1)[None], v.transpose(0, 1)[None], enable_gqa=True, **kw)

    def repeat():
        kr, vr = (x.repeat_interleave(hq // hkv, dim=1).transpose(0, 1)[None] for x in (k, v))
        return _sdpa(qh, kr, vr, **kw)

    same = torch.equal(gqa(), repeat())
    return {"rows": rows, "length": length, "bitwise_equal": same,
            "gqa_ms": median_ms(gqa, iters), "repeat_ms": median_ms(repeat, iters)}



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--out", default="gqa_sdpa.json")
    args = ap.parse_args()
    res = []
    for _ in range(2):  # the arms in turn, twice
        for rows, length in ((8192, 8192), (288, 8480)):
            r = arms(rows, length, args.iters)
            res.append(r)
            print(f"{rows:5d} rows over {length:5d}: grouped {r['gqa_ms']:.3f} ms, repeated "
                  f"{r['repeat_ms']:.3f} ms, bitwise equal {r['bitwise_equal']}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
