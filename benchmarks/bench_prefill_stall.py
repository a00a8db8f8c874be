"""How long a long new prompt stalls a request that is already decoding.

One greedy request decodes; then a prompt of `--prompt-tokens` tokens arrives. Prints the
longest gap (seconds) between the running request's tokens while that prompt is read in, and
the new request's time to its first token. Runs the embedded default model unless --model.

    python benchmarks/bench_prefill_stall.py --prompt-tokens 16384 [--device cpu] [--out f.json]
"""

from __future__ import annotations

import argparse
import json
import time

from deltaserve import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--prompt-tokens", type=int, default=16384)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    engine = LLM(args.model, device=args.device).engine
    running = engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=400,
                                                           ignore_eos=True))
    while not any(o.rid == running and o.new_token_ids for o in engine.step()):
        pass
    prompt = [(i * 7) % 8000 + 10 for i in range(args.prompt_tokens)]
    new = engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    start = last = time.monotonic()
    gaps, ttft = [], None
    while engine.has_unfinished():
        outs = engine.step()
        now = time.monotonic()
        for out in outs:
            if out.rid == running and out.new_token_ids:
                gaps.append(now - last)
                last = now
            if out.rid == new and out.new_token_ids and ttft is None:
                ttft = now - start
    row = {"prompt_tokens": args.prompt_tokens, "chunk_size": engine.cfg.chunk_size,
           "longest_gap_s": max(gaps), "new_request_ttft_s": ttft}
    print(f"prompt {args.prompt_tokens} tokens (chunks of {row['chunk_size']}): longest gap "
          f"between the running request's tokens {row['longest_gap_s']:.2f} s, the new "
          f"request's first token after {ttft:.2f} s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(row, f, indent=1)


if __name__ == "__main__":
    main()
