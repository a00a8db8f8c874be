"""Prefix-cache TTFT benchmark: resuming a long conversation far back (TARGETS.md, "End to end").

Time to first token (wall clock around the engine steps, CUDA synchronised) of
  (a) a cold prompt of --prompt-tokens tokens (with snapshots being taken: their overhead),
  (b) its next turn (prompt + answer + a new message),
  (c) a replay cut at 75% of the prompt plus a new message,
  (d) a --turns conversation built turn by turn, then other prompts pushing its snapshots out
      of the device slots (into the host bank when there is one), then its last turns resent,
each on an engine with a host bank (--host-snapshot-slots) and on one without ("device"), as
ratios against a cold prefill of the same prompt on an engine with the cache off; and a sweep
of TTFT against the cut point (after the pushing) for cold / device-only / bank. Random-weight
Qwen3.5-style model as bench_e2e.py (bf16 on CUDA). Prints a table, writes JSON (--out) and a
PNG (--plot) when matplotlib is importable.

With --shared-prompt it runs only (e): --shared-requests requests, one after another, sharing
a --shared-tokens system prompt and each with --unique-tokens of its own, at the default chunk
size: mean TTFT and cached tokens with fork snapshots, without them (fork_snapshots=False),
and cold (cache off).

    python benchmarks/bench_prefix.py --out prefix.json --plot prefix.png
    python benchmarks/bench_prefix.py --shared-prompt --out shared.json
    python benchmarks/bench_prefix.py --smoke --out /tmp/prefix.json   # tiny, CPU, seconds
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import tempfile
import time

import torch

from deltaserve import LLM, SamplingParams

MODES = ("device", "bank")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab - 1) for _ in range(n)]


def run(llm: LLM, prompt: list[int], max_tokens: int = 1) -> dict:
    """One request through the engine: TTFT (s), cached tokens, the generated tokens."""
    eng, dev = llm.engine, llm.engine.device.type
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    sync(dev)
    start = time.perf_counter()
    rid = eng.add_request(prompt, params)
    ttft, out, cached = None, [], 0
    while eng.has_unfinished():
        for o in eng.step():
            if o.rid != rid:
                continue
            if o.new_token_ids and ttft is None:
                sync(dev)
                ttft = time.perf_counter() - start
            out += o.new_token_ids
            cached = o.cached_tokens
    return {"ttft_s": ttft, "cached_tokens": cached, "prompt_tokens": len(prompt),
            "tokens": out}


def timed(llm: LLM, prompt: list[int], cold: LLM, max_tokens: int = 1) -> dict:
    """`prompt` on `llm`, with the TTFT of a cold prefill of it and the ratio of the two."""
    got = run(llm, prompt, max_tokens)
    base = run(cold, prompt)["ttft_s"]
    return {**got, "cold_ttft_s": base, "ratio_to_cold": got["ttft_s"] / base}


def push_out(llm: LLM, args, seed: int) -> int:
    """Prompts unrelated to anything cached, enough to turn the device snapshot slots over
    twice: the conversation's snapshots leave the device (to the bank, or dropped)."""
    per = args.other_tokens // args.chunk_size + 2  # chunk ends + last boundary + release
    n = args.others or math.ceil(2 * args.device_snapshot_slots / per)
    for i in range(n):
        run(llm, tokens(args.other_tokens, args.vocab, seed + i))
    return n


def first_turns(llm: LLM, cold: LLM, args) -> dict:
    """(a), (b), (c) on a flushed engine."""
    llm.engine.flush_cache()
    p = tokens(args.prompt_tokens, args.vocab, 1)
    res = {"a_cold_prompt": timed(llm, p, cold, args.answer_tokens)}
    answer = res["a_cold_prompt"].pop("tokens")
    nxt = p + answer + tokens(args.message_tokens, args.vocab, 2)
    res["b_next_turn"] = timed(llm, nxt, cold)
    new_only = tokens(len(nxt) - res["b_next_turn"]["cached_tokens"], args.vocab, 3)
    res["b_next_turn"]["new_only_ttft_s"] = run(cold, new_only)["ttft_s"]
    cut = p[:int(0.75 * len(p))] + tokens(args.message_tokens, args.vocab, 4)
    res["c_replay_75pct"] = timed(llm, cut, cold)
    for r in res.values():
        r.pop("tokens", None)
    return res


def conversation(llm: LLM, cold: LLM, args) -> dict:
    """(d): --turns turns of --prompt-tokens/--turns new tokens each, pushed out, resent."""
    llm.engine.flush_cache()
    per_turn = max(1, args.prompt_tokens // args.turns)
    history, prompts = [], []
    for t in range(args.turns):
        history += tokens(per_turn, args.vocab, 1000 + t)
        prompts.append(list(history))
        history += run(llm, history, args.turn_answer_tokens)["tokens"]
    status = llm.engine.cache_status()
    n_others = push_out(llm, args, 5000)
    after = llm.engine.cache_status()
    replays = []
    for prompt in prompts[-args.replay_turns:]:
        r = timed(llm, prompt, cold)
        r.pop("tokens")
        replays.append(r)
    return {"turns": args.turns, "conversation_tokens": len(history), "others": n_others,
            "snapshots_before_push": {k: status[k] for k in ("slots_snapshot",
                                                             "host_slots_snapshot")},
            "snapshots_after_push": {k: after[k] for k in ("slots_snapshot",
                                                           "host_slots_snapshot")},
            "replays": replays}


def sweep(engines: dict[str, LLM], cold: LLM, args) -> list[dict]:
    """TTFT of the --prompt-tokens prompt cut at each of --cuts plus a new message, after
    other prompts pushed its snapshots off the device."""
    p = tokens(args.prompt_tokens, args.vocab, 7)
    for llm in engines.values():
        llm.engine.flush_cache()
        run(llm, p)
        push_out(llm, args, 9000)
    rows = []
    for i, frac in enumerate(args.cuts):
        prompt = p[:int(frac * len(p))] + tokens(args.message_tokens, args.vocab, 100 + i)
        row = {"cut": frac, "prompt_tokens": len(prompt),
               "cold_ttft_s": run(cold, prompt)["ttft_s"]}
        for mode, llm in engines.items():
            got = run(llm, prompt)
            row[f"{mode}_ttft_s"] = got["ttft_s"]
            row[f"{mode}_cached_tokens"] = got["cached_tokens"]
        rows.append(row)
    return rows


def shared_prompt(engines: dict[str, LLM], args) -> dict:
    """(e): the same requests on each engine, one after another (after a flush); per engine
    the TTFT and cached tokens of each, their means, and the means from request 3 on (1
    caches the shared prompt's KV, 2 takes the fork snapshot)."""
    system = tokens(args.shared_tokens, args.vocab, 11)
    batch = [system + tokens(args.unique_tokens, args.vocab, 20000 + i)
             for i in range(args.shared_requests)]
    res = {}
    for mode, llm in engines.items():
        llm.engine.flush_cache()
        runs = [run(llm, p) for p in batch]
        ttft, cached = [r["ttft_s"] for r in runs], [r["cached_tokens"] for r in runs]
        res[mode] = {"ttft_s": ttft, "cached_tokens": cached,
                     "mean_ttft_s": sum(ttft) / len(ttft),
                     "mean_ttft_from_3rd_s": sum(ttft[2:]) / max(1, len(ttft) - 2),
                     "mean_cached_tokens": sum(cached) / len(cached),
                     "fork_snapshots_taken": llm.engine.cache_status()["fork_snapshots_taken"]}
        progress(f"shared prompt: {mode} done", res, args)
    return res


def report_shared(res: dict) -> None:
    print(f"{'engine':10s} {'mean ttft ms':>13s} {'from 3rd ms':>12s} {'mean cached':>12s} "
          f"{'forks':>6s}")
    for mode, r in res.items():
        print(f"{mode:10s} {1000 * r['mean_ttft_s']:13.2f} {1000 * r['mean_ttft_from_3rd_s']:12.2f}"
              f" {r['mean_cached_tokens']:12.1f} {r['fork_snapshots_taken']:6d}")


def plot(rows: list[dict], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"matplotlib is not importable: no plot written to {path}")
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    cuts = [100 * r["cut"] for r in rows]
    for key, label in (("cold", "cold (cache off)"), ("device", "device snapshots only"),
                       ("bank", "with host bank")):
        ax.plot(cuts, [1000 * r[f"{key}_ttft_s"] for r in rows], marker="o", label=label)
    ax.set_xlabel("cut point (% of the cached prompt)")
    ax.set_ylabel("TTFT (ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot written to {path}")


def make_engine(path: str, args, **kw) -> LLM:
    return LLM(path, device=args.device, dtype=args.dtype, kv_memory_gb=args.kv_memory_gb,
               page_size=args.page_size, chunk_size=args.chunk_size,
               max_num_batched_tokens=max(args.chunk_size, 8192), max_running_reqs=4,
               num_snapshot_slots=args.device_snapshot_slots, **kw)


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prompt-tokens", type=int, default=32768)
    ap.add_argument("--message-tokens", type=int, default=256, help="a new message's length")
    ap.add_argument("--answer-tokens", type=int, default=32, help="answer generated in (a)")
    ap.add_argument("--turn-answer-tokens", type=int, default=8,
                    help="answer generated per turn in (d): decode past 8,192 KV positions "
                         "runs without CUDA graphs, so long answers dominate the run time")
    ap.add_argument("--turns", type=int, default=40)
    ap.add_argument("--replay-turns", type=int, default=3, help="last turns resent in (d)")
    ap.add_argument("--other-tokens", type=int, default=4096, help="length of pushing prompts")
    ap.add_argument("--others", type=int, default=0, help="pushing prompts (0: enough to "
                    "turn the device snapshot slots over twice)")
    ap.add_argument("--host-snapshot-slots", type=int, default=256)
    ap.add_argument("--device-snapshot-slots", type=int, default=64)
    ap.add_argument("--chunk-size", type=int, default=2048)
    ap.add_argument("--page-size", type=int, default=16)
    ap.add_argument("--kv-memory-gb", type=float, default=16.0)
    ap.add_argument("--cuts", type=float, nargs="+",
                    default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny model and sizes on the CPU (checks the script, not speed)")
    ap.add_argument("--shared-prompt", action="store_true",
                    help="run only (e), the shared-system-prompt case")
    ap.add_argument("--shared-requests", type=int, default=32)
    ap.add_argument("--shared-tokens", type=int, default=4000)
    ap.add_argument("--unique-tokens", type=int, default=500)
    ap.add_argument("--out", default="prefix.json")
    ap.add_argument("--plot", default=None, help="PNG path (default: --out with .png)")
    args = ap.parse_args()
    if args.smoke:
        args.device, args.dtype, args.vocab = "cpu", "float32", 512
        args.prompt_tokens, args.message_tokens, args.answer_tokens = 640, 16, 4
        args.turn_answer_tokens = 4
        args.turns, args.replay_turns, args.other_tokens = 5, 2, 192
        args.host_snapshot_slots, args.device_snapshot_slots = 32, 6
        args.chunk_size, args.kv_memory_gb, args.cuts = 64, 0.05, [0.25, 0.5, 0.75]
        if args.shared_prompt:  # chunk ends must miss the shared part, as at the defaults
            args.chunk_size, args.shared_requests = 2048, 4
            args.shared_tokens, args.unique_tokens = 1000, 200
    args.plot = args.plot or os.path.splitext(args.out)[0] + ".png"
    return args


def build(path: str, args) -> int:
    """The checkpoint: bench_e2e's random Qwen3.5-style model, or the tiny test one (smoke)."""
    if args.smoke:
        from deltaserve.model.testing import make_tiny_checkpoint

        make_tiny_checkpoint(path, "qwen3_5_text", seed=0)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_e2e import build_checkpoint

    return build_checkpoint(path, args.hidden, args.layers, args.vocab)


def main() -> None:
    args = parse_args()
    res: dict = {"config": {k: v for k, v in vars(args).items()}}
    with tempfile.TemporaryDirectory() as path:
        res["params"] = build(path, args)
        cold = make_engine(path, args, enable_prefix_cache=False)
        if args.shared_prompt:
            engines = {"fork": make_engine(path, args), "no-fork": make_engine(
                path, args, fork_snapshots=False), "cold": cold}
            warm = tokens(args.shared_tokens + args.unique_tokens, args.vocab, 99)
            for llm in engines.values():  # first passes compile fla-core's Triton kernels
                run(llm, warm)
                run(llm, warm[:args.unique_tokens])
            progress("warm-up done", res, args)
            res["e_shared_prompt"] = shared_prompt(engines, args)
            report_shared(res["e_shared_prompt"])
            save(res, args)
            return
        engines = {"device": make_engine(path, args),
                   "bank": make_engine(path, args, host_snapshot_slots=args.host_snapshot_slots)}
        warm = tokens(args.prompt_tokens, args.vocab, 99)
        for llm in (cold, *engines.values()):  # first passes compile fla-core's Triton kernels
            for n in (args.prompt_tokens, args.message_tokens):
                run(llm, warm[:n])
            llm.engine.flush_cache()
        progress("warm-up done", res, args)
        for mode, llm in engines.items():
            res[mode] = first_turns(llm, cold, args)
            progress(f"{mode}: (a)-(c) done", res, args)
            res[mode]["d_conversation"] = conversation(llm, cold, args)
            progress(f"{mode}: (d) done", res, args)
        res["sweep"] = sweep(engines, cold, args)
    report(res)
    save(res, args)
    plot(res["sweep"], args.plot)


_T0 = time.perf_counter()


def progress(what: str, res: dict, args) -> None:
    """A timestamped line, and the JSON so far (a run cut short still leaves its results)."""
    print(f"[{time.perf_counter() - _T0:7.1f} s] {what}", flush=True)
    save(res, args)


def save(res: dict, args) -> None:
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


def report(res: dict) -> None:
    print(f"{'case':28s} {'mode':7s} {'cached':>8s} {'ttft ms':>9s} {'cold ms':>9s} {'ratio':>6s}")
    for mode in MODES:
        r = res[mode]
        rows = [(k, r[k]) for k in ("a_cold_prompt", "b_next_turn", "c_replay_75pct")]
        rows += [(f"d_replay_turn_{i}", x) for i, x in enumerate(r["d_conversation"]["replays"])]
        for name, x in rows:
            print(f"{name:28s} {mode:7s} {x['cached_tokens']:8d} {1000 * x['ttft_s']:9.2f} "
                  f"{1000 * x['cold_ttft_s']:9.2f} {x['ratio_to_cold']:6.2f}")
    print(f"{'cut':>5s} {'cold ms':>9s} " + " ".join(f"{m + ' ms':>10s} {'cached':>7s}"
                                                   for m in MODES))
    for row in res["sweep"]:
        print(f"{row['cut']:5.2f} {1000 * row['cold_ttft_s']:9.2f} " + " ".join(
            f"{1000 * row[m + '_ttft_s']:10.2f} {row[m + '_cached_tokens']:7d}" for m in MODES))


if __name__ == "__main__":
    main()
