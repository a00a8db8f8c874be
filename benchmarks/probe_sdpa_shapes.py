"""Probe: what a prompt of a length not seen before costs in SDPA set-up. Times
scaled_dot_product_attention at new and repeated lengths per backend (cuDNN builds an execution
plan per shape), then the default model's TTFT at new lengths (prefix cache flushed), with the
engine's prefill SDPA backends as they are or with cuDNN put first (`--cudnn-first`: the engine
before session 38 took torch's order, cuDNN first on sm90).
    python benchmarks/probe_sdpa_shapes.py --out sdpa.json
    python benchmarks/probe_sdpa_shapes.py --cudnn-first --out sdpa_old.json
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from deltaserve import LLM, SamplingParams


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def sdpa_probe(backend, lengths, hq=8, d=256) -> dict:
    dev = "cuda"
    first, again = [], []
    for n in lengths:
        q, k, v = (torch.randn(1, hq, n, d, device=dev, dtype=torch.bfloat16) for _ in range(3))
        def call(q=q, k=k, v=v):
            if backend is None:
                F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                with sdpa_kernel([backend]):
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
        first.append(timed(call))
        again.append(timed(call))
    return {"first_ms": [round(x * 1e3, 3) for x in first],
            "again_ms_median": statistics.median(again) * 1e3}


def ttft_probe(llm, vocab, lengths) -> dict:
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    rng = random.Random(0)
    out = {}
    for n in lengths:
        ids = [rng.randrange(vocab - 1) for _ in range(n)]
        llm.engine.flush_cache()
        out[n] = round(timed(lambda ids=ids: llm.generate([ids], one)) * 1e3, 2)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="sdpa.json")
    ap.add_argument("--no-cudnn", action="store_true", help="TTFT with cuDNN SDPA disabled")
    ap.add_argument("--cudnn-first", action="store_true",
                    help="TTFT with cuDNN first among the engine's prefill SDPA backends (the "
                         "engine before it left cuDNN out)")
    args = ap.parse_args()
    res = {}
    if args.no_cudnn:
        torch.backends.cuda.enable_cudnn_sdp(False)
    if args.cudnn_first:
        from deltaserve.engine import prefill_attention
        prefill_attention.SDPA_BACKENDS.insert(0, SDPBackend.CUDNN_ATTENTION)
    torch.randn(8, device="cuda")
    backends = [("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION)]
    for name, b in [] if args.no_cudnn or args.cudnn_first else backends:
        base = {"default": 300, "flash": 400, "efficient": 500, "cudnn": 600}[name]
        try:
            res[f"sdpa_{name}"] = r = sdpa_probe(b, [base + i for i in range(6)])
        except RuntimeError as e:
            res[f"sdpa_{name}"] = r = {"error": str(e)[:200]}
        print(name, r, flush=True)
    llm = LLM(None, device="cuda")
    vocab = llm.engine.model.config.vocab_size
    ttft_probe(llm, vocab, [256, 256])  # warm-up
    res["ttft_default_ms"] = r = ttft_probe(llm, vocab, [256, 256, 257, 258, 259, 700, 701, 256])
    print("default model TTFT ms by prompt length (new lengths after 256):", r, flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


if __name__ == "__main__":
    main()
