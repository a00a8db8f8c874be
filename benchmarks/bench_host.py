"""Host-side (CPU) costs the engine pays every decode / verify step, beside their definitions.

Times, on this machine's CPU: the n-gram proposer's lookup over a long sequence with no match
(the worst case) against the brute-force definition; the CUDA-graph step's attention metadata
for a batch against the per-request definition. Both definitions are the test oracles in
tests/spec/test_ngram.py and tests/engine/test_attention_metadata.py. Prints a table and
writes JSON.

    python benchmarks/bench_host.py --out host.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from collections.abc import Callable

import numpy as np
import torch

from deltaserve.engine.attention import PagedMetadata
from deltaserve.spec.ngram.proposer import NgramProposer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from engine.test_attention_metadata import reference_paged  # noqa: E402
from spec.test_ngram import reference_lookup  # noqa: E402


def per_call_ms(fn: Callable[[], object], min_s: float = 0.5) -> float:
    fn()
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < min_s:
        fn()
        n += 1
    return (time.perf_counter() - t0) / n * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq-len", type=int, default=32768)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--kv-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--out", default="host.json")
    args = ap.parse_args()
    rng = random.Random(0)
    ids = [rng.randrange(150_000) for _ in range(args.seq_len)]
    arr = np.array(ids)
    ngram = NgramProposer(3)
    starts = [rng.randint(args.kv_len // 2, args.kv_len - args.rows) for _ in range(args.batch)]
    tables = [rng.sample(range(1, 100_000), -(-(s + args.rows) // args.page_size))
              for s in starts]
    meta = PagedMetadata.allocate(args.batch, args.rows, args.kv_len, args.page_size,
                                  torch.device("cpu"))
    max_pages = meta.page_table.shape[1]
    rows = {
        f"ngram lookup, {args.seq_len} tokens, no match": (
            per_call_ms(lambda: ngram.lookup(arr)),
            per_call_ms(lambda: reference_lookup(ids, 3), min_s=0.2)),
        f"graph-step attention metadata, {args.batch} req x {args.rows} rows x "
        f"{args.kv_len} KV": (
            per_call_ms(lambda: meta.fill(tables, starts, args.page_size)),
            per_call_ms(lambda: reference_paged(tables, starts, args.rows, args.page_size,
                                                args.batch, max_pages), min_s=0.2)),
    }
    print(f"{'what':60s} {'engine ms':>10s} {'definition ms':>14s}")
    for what, (ours, ref) in rows.items():
        print(f"{what:60s} {ours:10.3f} {ref:14.3f}")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": {k: {"engine_ms": a, "definition_ms": b}
                                                 for k, (a, b) in rows.items()}}, f, indent=2)


if __name__ == "__main__":
    main()
