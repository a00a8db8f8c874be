"""Prefill speed of the 0.8B config (issue 27): time to first token of a 256-token prompt
(target <= 20 ms) and 8,192-token prefill tok/s (target >= 120k), each beside the forwards it
took, kernels per forward and the device's share of the wall time (prefill_kernels.py).

Rows: `ttft256` (a 64n-token prompt: its track snapshot at 192 is written inside the forward),
`ttft300` (past its last boundary, 256), `prefill8k`, and with --compare the same prompts with
the prompt's last chunk cut at its track depth as before (one more forward: `*_cut`).
Prints a table and writes JSON.

    python benchmarks/bench_prefill.py --out prefill.json            # ~60-90 s, most of it
    python benchmarks/bench_prefill.py --compare --out prefill.json  # the checkpoint + compiles
"""

from __future__ import annotations

import argparse
import json
import tempfile

import torch
from bench_e2e import build_checkpoint, prompt  # a sibling script
from prefill_kernels import prefill_forwards, report, ttft

from deltaserve import LLM


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=248320)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--long", type=int, default=8192)
    ap.add_argument("--model", default=None,
                    help="a checkpoint folder instead of a random 0.8B-config one")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--compare", action="store_true",
                    help="also with the last chunk cut at the track depth (the old path)")
    ap.add_argument("--out", default="prefill.json")
    args = ap.parse_args()
    res: dict = {"config": vars(args).copy()}
    cases = {"ttft256": prompt(256, args.vocab, 4), "ttft300": prompt(300, args.vocab, 5),
             "prefill8k": prompt(args.long, args.vocab, 6)}
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or tmp
        if args.model is None:
            res["params"] = build_checkpoint(tmp, args.hidden, args.layers, args.vocab)
        dtype = "bfloat16" if args.device == "cuda" else "float32"
        llm = LLM(path, device=args.device, dtype=dtype, kv_memory_gb=8.0, page_size=16,
                  chunk_size=8192, max_num_batched_tokens=8192, max_running_reqs=4,
                  cuda_graphs=False)
        snaps = llm.engine.scheduler.snaps
        modes = [("", True)] + ([("_cut", False)] if args.compare else [])
        for suffix, in_forward in modes:
            snaps.in_forward = in_forward
            for ids in cases.values():  # compiles and autotunes fla-core's kernels per shape
                ttft(llm, ids, runs=1)
            for name, ids in cases.items():
                t = ttft(llm, ids, runs=5 if len(ids) <= 512 else 3)
                f = prefill_forwards(llm, ids)
                row = {**t, **f, "tokens": len(ids), "tok_s": len(ids) / t["ttft_s"]}
                res[name + suffix] = row
                print(report(name + suffix, t, f), f" {row['tok_s'] / 1e3:.1f}k tok/s",
                      flush=True)
        del llm
        if args.device == "cuda":
            torch.cuda.empty_cache()
    r = res["ttft256"]
    print(f"TTFT 256: {1e3 * r['ttft_s']:.2f} ms (target <= 20); prefill {args.long}: "
          f"{res['prefill8k']['tok_s'] / 1e3:.1f}k tok/s (target >= 120k)")
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
