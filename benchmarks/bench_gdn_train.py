"""The training-time GDN chunk rule (default_model/gdn_chunked.py): forward + backward seconds
of `chunk_gated_delta_rule_torch` for each `--solve` at the retraining's head shape (H 6 key
heads, HV 12 value heads, K = V = 32, L2-normed q/k), on random inputs, best of `--repeats`.
The gradients' sums are printed beside the times: the solves agree (tests own correctness).

    python benchmarks/bench_gdn_train.py --batch 4 [--seq 1024] [--device cpu] [--repeats 8]
"""

from __future__ import annotations

import argparse
import time

import torch

from deltaserve.default_model.gdn_chunked import chunk_gated_delta_rule_torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=8)
    args = ap.parse_args()
    dev, gen = torch.device(args.device), torch.Generator().manual_seed(0)
    b, t, h, hv, k = args.batch, args.seq, 6, 12, 32
    inputs = [torch.randn(b, t, h, k, generator=gen), torch.randn(b, t, h, k, generator=gen),
              torch.randn(b, t, hv, k, generator=gen), -torch.rand(b, t, hv, generator=gen),
              torch.rand(b, t, hv, generator=gen)]
    for solve in ("trsm", "blocked"):
        xs = [x.to(dev).requires_grad_() for x in inputs]
        times = []
        for _ in range(args.repeats):
            for x in xs:
                x.grad = None
            t0 = time.perf_counter()
            out, _ = chunk_gated_delta_rule_torch(*xs, use_qk_l2norm_in_kernel=True, solve=solve)
            out.square().sum().backward()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        sums = [f"{x.grad.abs().sum().item():.6g}" for x in xs]
        print(f"{solve:8s} best {min(times):.3f} s, median {sorted(times)[len(times) // 2]:.3f} s"
              f" (batch {b} x {t}, {args.device}); |grad| sums {' '.join(sums)}")


if __name__ == "__main__":
    main()
