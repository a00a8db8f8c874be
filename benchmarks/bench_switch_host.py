"""What switching between plain decode and verify steps costs the host: a CPU proxy.

The adaptive speculation policy (spec/policy.py) mixes plain decode steps (overlapped,
engine/overlap.py) and verify steps (synchronous). A switch is dearer than either kind in a
run: the first verify after plain steps catches up, eagerly, the MTP rows they left
(spec/mtp/proposer.py) and drains the overlap pipeline; the first plain step after a verify
runs without overlap. This runs bench_step_host.py's stubbed engine (the embedded default
model; graph replays return their warm-up outputs) with both kinds' graphs built, each replay
spun for --spin-* us to stand for the GPU's step (so a host-bound GPU's ratios hold), the
eager MTP head spun for --spin-eager us (its launches), and each verify accepting a random
number of drafts (each draft with probability --accept-p, the same for every request of a
step). Decode steps follow a pattern over the steps launched ("v": verify, "d": plain;
"vdddd" verifies every 5th step) or the engine's adaptive policy ("adaptive", after a forced
verify run and a forced plain run, as bench_spec's warm_both_kinds).

Per configuration: us per generated token-step (best and median of --reps runs of
--max-tokens tokens per request), the steps, verify share and switches, the eager MTP
catch-ups, and the median cost the policy is told (spec/policy.py StepClock) of steps that
start a run of their kind ("first") and of steps that continue one ("cont"). A proxy of the
GPU host's time, not a GPU figure (see bench_step_host.py).

    python benchmarks/bench_switch_host.py --batches 1 --patterns d,v,vddddddddddddd,adaptive \
        --spin-plain 120 --spin-verify 500 --spin-mtp 400
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bench_spec import warm_both_kinds  # sibling scripts
from bench_step_host import PROMPT

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner, hidden_ring_steps


def spin(us: float) -> None:
    end = time.perf_counter() + us * 1e-6
    while time.perf_counter() < end:
        pass


def stubbed_engine(algo: str, batch: int, args: argparse.Namespace) -> LLM:
    """An adaptive-policy engine whose graphs (every bucket, both kinds) replay by spinning."""
    n = max(batch, 8)
    llm = LLM(None, device="cpu", dtype="float32", enable_prefix_cache=False,
              max_running_reqs=n, speculative_algorithm=algo, speculative_num_steps=3,
              speculative_policy="adaptive")
    eng = llm.engine
    eng.graphs = GraphRunner(eng.runner, n, 4, eng.max_model_len, capture=False)
    if algo == "mtp":
        eng.spec.use_graphs(n, eng.max_model_len, capture=False)
    eng.decode_graphs = GraphRunner(eng.runner, n, 1, eng.max_model_len, capture=False,
                                    hidden_ring=hidden_ring_steps(eng.spec, eng.model, n))
    llm.prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    # real outputs in every graph's buffers before the stubs
    warm_both_kinds(llm, [llm.prompt] * batch,
                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    runners = [eng.graphs, eng.decode_graphs]
    if algo == "mtp":
        runners.append(eng.spec.proposer.graphs)
    for r in runners:
        r.capture_all()
    gen = torch.Generator().manual_seed(0)

    def verify_replay(g):
        def replay():
            spin(args.spin_verify)
            u = torch.rand(1, 3, generator=gen) < args.accept_p
            g.accepted[:, 0] = u.expand(g.accepted.shape[0], 3).long().cumprod(1).sum(1)
        return replay

    for g in eng.graphs.graphs.values():
        g.replay = verify_replay(g)
        g.gdn.commit = lambda accepted, slot_ids: None
    for g in eng.decode_graphs.graphs.values():
        g.replay = lambda: spin(args.spin_plain)
    if algo == "mtp":
        for g in eng.spec.proposer.graphs.graphs.values():
            g.replay = lambda: spin(args.spin_mtp)
        eng.spec.proposer.head = lambda ids, hidden, ctx: (spin(args.spin_eager), hidden)[1]
    eng.runner.commit_verify = lambda counts: None
    return llm


def run(algo: str, batch: int, pattern: str, args: argparse.Namespace) -> dict:
    llm = stubbed_engine(algo, batch, args)
    eng = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    verifies = [0]
    propose = eng.spec.propose

    def counted_propose(b):
        verifies[0] += 1
        return propose(b)

    eng.spec.propose = counted_propose
    if pattern == "adaptive":
        warm_both_kinds(llm, [llm.prompt] * batch, params)
    else:  # by the steps launched so far (the overlap scheduler asks before a step lands)
        eng.scheduler.choose_drafts = lambda reqs: 3 if pattern[
            (eng.overlap.launched_steps + verifies[0]) % len(pattern)] == "v" else 0
    told: list[tuple[int, float]] = []
    on_step = eng.policy.on_step
    eng.policy.on_step = lambda k, b, s: (told.append((k, s)), on_step(k, b, s))[1]
    catch_ups = [0]
    if algo == "mtp":
        catch_up = eng.spec.proposer._catch_up
        eng.spec.proposer._catch_up = lambda reqs, keep=0: (
            catch_ups.__setitem__(0, catch_ups[0] + 1), catch_up(reqs, keep))[1]
    runs = []
    for _ in range(args.reps):
        for _ in range(batch):
            eng.add_request(list(llm.prompt), params)
        while eng.scheduler.waiting or any(r.in_prefill for r in eng.scheduler.running):
            eng.step()
        told.clear()
        catch_ups[0] = 0
        t0 = time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        runs.append(((time.perf_counter() - t0) / (args.max_tokens - 1), list(told),
                     catch_ups[0]))
    best = min(runs, key=lambda r: r[0])
    steps = best[1]
    kinds: dict[str, list[float]] = {}
    for i, (k, s) in enumerate(steps[1:], 1):  # the step after the prefill: neither
        first = bool(steps[i - 1][0]) != bool(k)
        kinds.setdefault(("verify" if k else "plain") + ("_first" if first else "_cont"),
                         []).append(s * 1e6)
    return {"algo": algo, "batch": batch, "pattern": pattern,
            "us_per_token_step": round(best[0] * 1e6, 1),
            "median_us": round(statistics.median(r[0] for r in runs) * 1e6, 1),
            "steps": len(steps), "verify_share": sum(1 for k, _ in steps if k) / len(steps),
            "switches": sum(bool(a[0]) != bool(b[0]) for a, b in zip(steps, steps[1:])),
            "eager_catch_ups": best[2],
            "told_us": {c: [len(v), round(statistics.median(v), 1)]
                        for c, v in sorted(kinds.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="mtp", choices=["mtp", "ngram"])
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--patterns", default="d,v,vddddddddddddd,vd,adaptive")
    ap.add_argument("--spin-plain", type=float, default=120.0, help="us per plain replay")
    ap.add_argument("--spin-verify", type=float, default=500.0, help="us per verify replay")
    ap.add_argument("--spin-mtp", type=float, default=400.0, help="us per MTP graph replay")
    ap.add_argument("--spin-eager", type=float, default=300.0,
                    help="us per eager MTP head forward (its launches on a GPU host)")
    ap.add_argument("--accept-p", type=float, default=0.81, help="each draft's acceptance")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="switch_host.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for pattern in args.patterns.split(","):
            row = run(args.algo, batch, pattern, args)
            rows.append(row)
            print(f"{args.algo} b{batch:<3d} {pattern:>16s}: {row['us_per_token_step']:7.1f} us "
                  f"a token-step (median {row['median_us']:.1f}), {row['steps']} steps, "
                  f"{row['verify_share']:.0%} verify, {row['switches']} switches, "
                  f"{row['eager_catch_ups']} eager catch-ups, told {row['told_us']}", flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
