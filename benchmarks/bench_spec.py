"""Speculative decoding benchmark: acceptance length and decode tokens/s, speculation off and on.

For each algorithm (n-gram, MTP on the model's own head) and each k in --ks, runs the same
greedy requests (--workload heldout: the first --prompt-tokens tokens of held-out corpus
files, unseen in training; repetitive: a short repeated code snippet) and reports the mean
acceptance length (tokens committed per request per verify step = accepted drafts + 1) and
decode tokens/s, beside the same run with speculation off. Checks that every configuration
returns the same tokens as speculation off: `same` counts requests with identical tokens,
`near_ties` those that part where the plain run's top-2 logit gap is below --tie-eps (one
bf16 ulp at logit scale ~4-8 is 0.03), `diff` those that part anywhere else (a bug). Prints
a table and writes JSON.

    python benchmarks/bench_spec.py --out spec.json [--model PATH] [--device cuda]
    python benchmarks/bench_spec.py --workload heldout --corpus build/corpus --batches 1,32
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from deltaserve import LLM, SamplingParams

REPETITIVE = ("def add(a, b):\n    return a + b\n\n\n"
              "def sub(a, b):\n    return a - b\n\n\n"
              "class Point:\n    def __init__(self, x, y):\n"
              "        self.x = x\n        self.y = y\n")


def heldout_prompts(llm: LLM, corpus: str, batch: int, n_tokens: int) -> list[list[int]]:
    """The first n_tokens tokens of `batch` held-out files (cycled when there are fewer files
    of that length); made by scripts/prepare_corpus.py."""
    from deltaserve.default_model.corpus import iter_split

    docs = [llm.tokenizer.encode(d.text, add_special_tokens=False)
            for d in iter_split(corpus, "heldout")]
    docs = [d[:n_tokens] for d in docs if len(d) > n_tokens]
    if not docs:
        raise ValueError(f"no held-out file in {corpus} has more than {n_tokens} tokens")
    return [docs[i % len(docs)] for i in range(batch)]


def workload(llm: LLM, batch: int, vocab: int, args: argparse.Namespace) -> list[list[int]]:
    if args.workload == "heldout":
        return heldout_prompts(llm, args.corpus, batch, args.prompt_tokens)
    if llm.tokenizer is not None:
        base = llm.tokenizer.encode(REPETITIVE * 3, add_special_tokens=False)
    else:
        base = [(i * 7) % (vocab - 1) for i in range(40)] * 3
    return [base[i:] + base[:i] for i in range(batch)]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(model: str | None, device: str, algo: str | None, k: int, batch: int,
        max_tokens: int, args: argparse.Namespace, dtype: str = "auto",
        fold: bool = True) -> dict:
    kw = {}
    if algo is not None:
        kw = dict(speculative_algorithm=algo, speculative_num_steps=k)
    llm = LLM(model, device=device, dtype=dtype, enable_prefix_cache=False,
              max_running_reqs=max(batch, 8), **kw)
    llm.engine.runner.fold_replay = fold
    prompts = workload(llm, batch, llm.engine.model.config.vocab_size, args)
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate(prompts, params)  # warm-up
    decode_s = time_decode(llm, prompts, one, params, device)
    eng = llm.engine
    eng.spec_steps = eng.spec_committed = 0
    gaps = record_gaps(llm, prompts, params) if algo is None else {}
    outs = llm.generate(prompts, params) if algo is not None else None
    tokens = [o.token_ids for o in outs] if outs is not None else gaps.pop("tokens")
    name = (algo or "off") + ("" if fold else "/unf")
    return {"algo": name, "k": k if algo else 0, "batch": batch,
            "decode_tok_s": batch * (max_tokens - 1) / max(decode_s, 1e-9),
            "acceptance_length": eng.acceptance_length if algo is not None else None,
            "tokens": tokens,
            "gaps": gaps.get("gaps")}


def time_decode(llm: LLM, prompts: list[list[int]], one: SamplingParams,
                params: SamplingParams, device: str) -> float:
    """Seconds of decoding (CUDA graphs as configured): all of `params` minus the prefill
    with one token."""
    sync(device)
    t0 = time.perf_counter()
    llm.generate(prompts, one)
    sync(device)
    t1 = time.perf_counter()
    llm.generate(prompts, params)
    sync(device)
    t2 = time.perf_counter()
    return (t2 - t1) - (t1 - t0)


def record_gaps(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> dict:
    """An extra, untimed plain run that records the top-2 logit gap of every generated
    position (eager: each step must pass the recorder); {"tokens": [...], "gaps": [...]}."""
    eng = llm.engine
    forward, graphs = eng.runner.forward, eng.graphs
    gaps: dict[int, list[float]] = {}

    def recording(batch, keep_hidden=False):
        out = forward(batch, keep_hidden)
        top2 = torch.topk(out.logits.float(), 2, dim=-1).values
        for req, gap in zip(out.owners, (top2[:, 0] - top2[:, 1]).tolist()):
            gaps.setdefault(req.rid, []).append(gap)
        return out

    eng.graphs, eng.runner.forward = None, recording
    try:
        outs = llm.generate(prompts, params)
    finally:
        eng.graphs, eng.runner.forward = graphs, forward
    return {"tokens": [o.token_ids for o in outs],
            "gaps": [gaps[k] for k in sorted(gaps)][-len(prompts):]}


def compare(base: dict, row: dict, eps: float) -> dict:
    """Per request: identical, parted at a near tie of the plain run, or parted elsewhere."""
    same = ties = diff = 0
    for i, (a, b) in enumerate(zip(base["tokens"], row["tokens"])):
        if a == b:
            same += 1
            continue
        j = next(k for k in range(min(len(a), len(b))) if a[k] != b[k])
        gap = base["gaps"][i][j] if base["gaps"] else float("inf")
        if gap < eps:
            ties += 1
        else:
            diff += 1
    return {"same": same, "near_ties": ties, "diff": diff}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint folder (default: embedded)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tie-eps", type=float, default=0.07)
    ap.add_argument("--out", default="spec.json")
    ap.add_argument("--unfolded", action="store_true",
                    help="also run each speculative config with the accepted rows replayed by "
                         "their own gdn_replay launch instead of folded into the next verify")
    ap.add_argument("--workload", choices=["repetitive", "heldout"], default="repetitive")
    ap.add_argument("--corpus", default="build/corpus", help="for --workload heldout")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="for --workload heldout")
    args = ap.parse_args()
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        base = run(args.model, args.device, None, 0, batch, args.max_tokens, args, args.dtype)
        rows.append(base)
        for algo in ("ngram", "mtp"):
            for k in [int(x) for x in args.ks.split(",")]:
                for fold in (True, False) if args.unfolded else (True,):
                    r = run(args.model, args.device, algo, k, batch, args.max_tokens, args,
                            args.dtype, fold)
                    r.update(compare(base, r, args.tie_eps))
                    r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
                    rows.append(r)
    print(f"{'algo':10s} {'k':>2s} {'batch':>5s} {'tok/s':>9s} {'accept':>7s} {'speedup':>7s} "
          "same/near-tie/diff")
    for r in rows:
        acc = f"{r['acceptance_length']:.2f}" if r.get("acceptance_length") else "-"
        print(f"{r['algo']:10s} {r['k']:2d} {r['batch']:5d} {r['decode_tok_s']:9.1f} {acc:>7s} "
              f"{r.get('speedup', 1.0):7.2f} "
              f"{r.get('same', '-')}/{r.get('near_ties', '-')}/{r.get('diff', '-')}")
    for r in rows:
        r.pop("tokens")
        r.pop("gaps")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
