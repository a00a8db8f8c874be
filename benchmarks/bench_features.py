"""What logprobs, a grammar and n-choice forks cost, on the embedded default model (it has a
tokenizer, which xgrammar needs).

Decode tokens/s at batch 1 and 32 for: plain greedy decoding, logprobs=5, a regex grammar
(xgrammar bitmask per row, applied to the logits after the forward / graph replay), with and
without n-gram speculation; and the wall time of n=8 choices of one 1,000-token prompt as forks
(the prompt prefilled once) against 8 independent requests with the prefix cache off. Prints a
table and writes JSON.

    python benchmarks/bench_features.py --out features.json [--device cuda] [--tokens 128]
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.grammar import GrammarSpec

REGEX = GrammarSpec("regex", r"[a-z ]+")  # the default model prefers code: every row is masked


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode_rate(llm: LLM, batch: int, tokens: int, device: str, **params) -> float:
    """Generated tokens per second over a batch of one-prompt requests (after a warm-up)."""
    prompt = llm.tokenizer.encode("def main():\n    ")
    sp = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, **params)
    llm.generate([prompt] * batch, sp)  # warm-up: graphs, the grammar compile
    sync(device)
    t0 = time.perf_counter()
    outs = llm.generate([prompt] * batch, sp)
    sync(device)
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def fork_times(device: str, n: int = 8, prompt_len: int = 1000) -> dict[str, float]:
    """Seconds for n choices of one prompt: forks (prefix cache on) vs n cold requests."""
    out = {}
    prompt = [(i * 31) % 7000 + 100 for i in range(prompt_len)]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
              for i in range(n)]
    for name, cache in (("forks", True), ("independent", False)):
        llm = LLM(None, device=device, enable_prefix_cache=cache, max_running_reqs=n)
        engine = llm.engine
        t0 = time.perf_counter()
        if cache:
            engine.add_forks(prompt, params)
        else:
            for p in params:
                engine.add_request(prompt, p)
        while engine.has_unfinished():
            engine.step()
        sync(device)
        out[name] = time.perf_counter() - t0
        out[f"{name}_prompt_tokens_computed"] = float(
            engine.cache_status()["prompt_tokens"] - engine.cache_status()["hit_tokens"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    rows = {}
    for spec in (None, "ngram"):
        cfg = dict(speculative_algorithm=spec, speculative_num_steps=3) if spec else {}
        llm = LLM(None, device=args.device, max_running_reqs=32, **cfg)
        for batch in (1, 32):
            for name, params in (("plain", {}), ("logprobs=5", {"logprobs": 5}),
                                 ("regex grammar", {"structured": REGEX})):
                key = f"{spec or 'no spec'} | batch {batch} | {name}"
                rows[key] = decode_rate(llm, batch, args.tokens, args.device, **params)
                print(f"{key:45s} {rows[key]:10.1f} tok/s", flush=True)
    forks = fork_times(args.device)
    for k, v in forks.items():
        print(f"n=8 {k:40s} {v:10.3f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"decode_tok_s": rows, "forks": forks, "device": args.device}, f,
                      indent=2)


if __name__ == "__main__":
    main()
