"""Speculative decoding benchmark: acceptance length and decode tokens/s, speculation off and on.

For each algorithm (n-gram, MTP on the model's own head) and each k in --ks, runs the same
greedy requests (--workload heldout: the first --prompt-tokens tokens of held-out corpus
files, unseen in training; repetitive: a short repeated code snippet) and reports the mean
acceptance length (tokens committed per request per verify step = accepted drafts + 1) and
decode tokens/s, beside the same run with speculation off, for each --policies entry (fixed:
every decode step verifies k drafts; adaptive: the engine picks k or a plain decode per step).
Per speculative row it also reports, as multiples of a plain decode step of the
speculation-off run (medians): `verify_x`, a verify step without its drafting (the target's
forward over k+1 rows, acceptance, commit); `draft_x`, the proposer's time per verify step
divided by k (one draft step, the MTP catch-up included); and the share of decode steps that
verified. Checks that every configuration
returns the same tokens as speculation off: `same` counts requests with identical tokens,
`near_ties` those that part where the plain run's top-2 logit gap is below --tie-eps (one
bf16 ulp at logit scale ~4-8 is 0.03), `diff` those that part anywhere else (a bug). Prints
a table and writes JSON.

Timing: every configuration of a batch size is built first, then timed in --rounds rounds,
each running every configuration once (in a rotated order): a run of the prompts with one
output token and one with all of them. Decode time is the best full run minus the best
one-token run. On 12-06 one engine per configuration timed back to back read speculation off
at batch 32 0.99 ms a step in one call and 0.49 in the next, beside 0.52 for a forced-plain
n-gram engine. Interleaved, the arms share a slow spell of the machine; an engine that is
slow for its whole life shows as a `paired` figure that stays off in every round.
`paired` is the median over rounds of the off run's time over this one's in the same round;
`spread` the slowest round over the fastest.

    python benchmarks/bench_spec.py --out spec.json [--model PATH] [--device cuda]
    python benchmarks/bench_spec.py --workload heldout --corpus build/corpus --batches 1,32
    python benchmarks/bench_spec.py --policies fixed,adaptive --batches 1,8,32,64 --ks 3
    python benchmarks/bench_spec.py --ks 3 --batches 1,32 --mtp-graphs on,off   # A/B
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import statistics
import tempfile
import time

import e2e_configs  # sibling scripts
import torch
from spec_view import kept_medians, policy_state, policy_view

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


class Arm:
    """One configuration of one batch size: its engine, built and warmed by `setup`, timed
    once per round by `time_round` (every arm of a batch size is alive at once and the rounds
    interleave them, so a slow spell of the machine hits every arm alike), read by `finish`."""

    def __init__(self, model: str | None, device: str, algo: str | None, k: int, batch: int,
                 args: argparse.Namespace, fold: bool = True, policy: str = "fixed",
                 mtp_graphs: bool = True, overlap_verify: bool = False) -> None:
        self.model, self.device, self.algo, self.k, self.batch = model, device, algo, k, batch
        self.args, self.fold, self.policy = args, fold, policy
        self.mtp_graphs, self.overlap_verify = mtp_graphs, overlap_verify
        self.full: list[float] = []  # seconds of each round's run of max_tokens
        self.prefill: list[float] = []  # and of its run of one token
        self.kinds: list[int] = []  # the k of each decode step inside the timed runs
        self.seconds: list[float] = []  # and the cost the policy was told of it
        self.policy_state: dict | None = None  # the policy's beliefs after the last round

    def setup(self) -> None:
        algo, policy, args = self.algo, self.policy, self.args
        kw = {}
        if algo is not None:  # "plain": the adaptive engine with every decode step forced plain
            kw = dict(speculative_algorithm=algo, speculative_num_steps=self.k,
                      speculative_policy="adaptive" if policy == "plain" else policy,
                      mtp_cuda_graphs=self.mtp_graphs and algo == "mtp",
                      overlap_verify=self.overlap_verify)
        if args.config is not None:  # random weights from config.json alone
            kw.update(load_format="dummy", dtype="bfloat16")
        else:
            kw["dtype"] = args.dtype
        llm = self.llm = LLM(self.model, device=self.device, enable_prefix_cache=False,
                             max_running_reqs=max(self.batch, 8), **kw)
        llm.engine.runner.fold_replay = self.fold
        self.prompts = workload(llm, self.batch, llm.engine.model.config.vocab_size, args)
        self.one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        self.params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                     ignore_eos=True)
        llm.generate(self.prompts, self.params)  # warm-up
        if policy == "adaptive":
            warm_both_kinds(llm, self.prompts, self.params)
        if policy == "plain":  # what speculation costs a step that does not speculate
            llm.engine.scheduler.choose_drafts = lambda reqs: 0
        self.before = graph_counts(llm.engine)

    def time_round(self) -> None:
        """One timed run of the prompt with one output token, then one of all of them."""
        eng = self.llm.engine
        if self.algo is not None:
            on_step = eng.policy.on_step
            eng.policy.on_step = lambda k, b, s: (self.kinds.append(k), self.seconds.append(s),
                                                  on_step(k, b, s))[2]
        try:
            for params, times in ((self.one, self.prefill), (self.params, self.full)):
                sync(self.device)
                t0 = time.perf_counter()
                self.llm.generate(self.prompts, params)
                sync(self.device)
                times.append(time.perf_counter() - t0)
        finally:
            if self.algo is not None:
                eng.policy.on_step = on_step
                self.policy_state = policy_state(eng.policy)

    def finish(self) -> dict:
        """The row of this arm (the untimed runs for its token check and step costs first),
        then its engine is dropped."""
        llm, eng, algo, max_tokens = self.llm, self.llm.engine, self.algo, self.args.max_tokens
        # captures and eager steps inside the timed runs (each capture costs tens of ms)
        timed_counts = {key: graph_counts(eng)[key] - n for key, n in self.before.items()}
        eng.spec_steps = eng.spec_committed = 0
        gaps = record_gaps(llm, self.prompts, self.params) if algo is None else {}
        costs = step_costs(llm, self.prompts, self.params, self.device) \
            if algo is not None else {}
        tokens = costs.pop("tokens") if algo is not None else gaps.pop("tokens")
        # the best run of each kind (a pause of tens of ms inside a 12 ms run read 2-20x off
        # on an H100 on 12-05), and each round's own difference for the spread
        decode_s = min(self.full) - min(self.prefill)
        rounds = [f - p for f, p in zip(self.full, self.prefill)]
        name = (algo or "off") + ("" if self.fold else "/unf") + \
            ("/eager" if algo == "mtp" and not self.mtp_graphs else "") + \
            ("/ov" if self.overlap_verify else "")
        kinds = self.kinds
        row = {"algo": name, "k": self.k if algo else 0, "batch": self.batch,
               "policy": self.policy if algo else "-",
               "decode_tok_s": self.batch * (max_tokens - 1) / max(decode_s, 1e-9),
               "step_s": decode_s / max(max_tokens - 1, 1),
               "round_step_s": [r / max(max_tokens - 1, 1) for r in rounds],
               "acceptance_length": eng.acceptance_length if algo is not None else None,
               "tokens": tokens, "timed_counts": timed_counts,
               "timed_verify_share": sum(1 for k in kinds if k) / len(kinds) if kinds else None,
               "gaps": gaps.get("gaps"),
               "chained_steps": eng.overlap.verify.chained_steps if eng.overlap else 0,
               **policy_view(self.policy_state, kinds, self.seconds), **costs}
        del self.llm
        return row


def graph_counts(eng) -> dict[str, int]:
    """Graphs captured so far and steps run eagerly, per graph runner of the engine."""
    out = {}
    proposer = getattr(eng.spec, "proposer", None) if eng.spec is not None else None
    for name, g in (("verify_or_decode", eng.graphs), ("plain", eng.decode_graphs),
                    ("mtp", getattr(proposer, "graphs", None))):
        if g is not None:
            out[f"{name}_captures"] = len(g.graphs)
            out[f"{name}_eager"] = getattr(g, "eager_steps", 0)
    return out


def warm_both_kinds(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> None:
    """Two more untimed runs, every decode step forced to verify, then to plain decode, so the
    policy has the costs and acceptance of both kinds, as a server's policy would from earlier
    requests. (They also captured both kinds' graphs before the engine captured every bucket
    at start-up; the timed runs' capture counts, `graph_counts`, show none is left.)"""
    sched, k = llm.engine.scheduler, llm.engine.cfg.speculative_num_steps
    choose = sched.choose_drafts
    try:
        for forced in (k, 0):
            sched.choose_drafts = lambda reqs, n=forced: n
            llm.generate(prompts, params)
    finally:
        sched.choose_drafts = choose


def step_costs(llm: LLM, prompts: list[list[int]], params: SamplingParams,
               device: str) -> dict:
    """An extra run that records each decode step's wall time (the policy's own measure) and
    the proposer's time per verify step (synchronised around it): median seconds of verify
    steps, of plain decode steps, of drafting, and the share of steps that verified."""
    eng = llm.engine
    steps: list[tuple[int, float]] = []
    drafting: list[float] = []
    on_step, propose = eng.policy.on_step, eng.spec.propose

    def recording_step(k, batch_size, seconds):
        steps.append((k, seconds))
        on_step(k, batch_size, seconds)

    def timed_propose(batch):
        sync(device)
        t0 = time.perf_counter()
        propose(batch)
        sync(device)
        drafting.append(time.perf_counter() - t0)

    eng.policy.on_step, eng.spec.propose = recording_step, timed_propose
    try:
        outs = llm.generate(prompts, params)
    finally:
        eng.policy.on_step, eng.spec.propose = on_step, propose
    verify = [s for k, s in steps if k]
    plain = [s for k, s in steps if not k]
    return {"tokens": [o.token_ids for o in outs],
            "verify_step_s": statistics.median(verify) if verify else None,
            "plain_step_s": statistics.median(plain) if plain else None,
            "draft_s": statistics.median(drafting) if drafting else None,
            "verify_share": len(verify) / max(len(steps), 1)}


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
    ap.add_argument("--config", default=None, choices=["0.8b"],
                    help="instead of --model: the 0.8B config (e2e_configs.dense_config) with "
                         "one MTP layer, random weights (--load-format dummy), bf16; it has no "
                         "tokenizer, so --workload repetitive repeats 40 token ids")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--ks", default="1,2,3,4")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--tie-eps", type=float, default=0.07)
    ap.add_argument("--rounds", type=int, default=5,
                    help="timed runs of each configuration, interleaved with the others'")
    ap.add_argument("--out", default="spec.json")
    ap.add_argument("--unfolded", action="store_true",
                    help="also run each speculative config with the accepted rows replayed by "
                         "their own gdn_replay launch instead of folded into the next verify")
    ap.add_argument("--workload", choices=["repetitive", "heldout"], default="repetitive")
    ap.add_argument("--corpus", default="build/corpus", help="for --workload heldout")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="for --workload heldout")
    ap.add_argument("--policies", default="fixed",
                    help="speculation policies to run, comma-separated: fixed, adaptive, "
                         "plain (the adaptive engine with every step forced to plain decode: "
                         "the cost of speculation being on)")
    ap.add_argument("--mtp-graphs", default="on",
                    help="MTP proposer as CUDA graphs, comma-separated: on, off (off: the "
                         "eager proposer, rows named mtp/eager)")
    ap.add_argument("--overlap-verify", default="off",
                    help="MTP verify steps launched before the previous one lands "
                         "(engine/overlap_verify.py), comma-separated: off, on (rows mtp/ov)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.config is not None:
            if args.model is not None or args.workload != "repetitive":
                ap.error("--config 0.8b has random weights and no tokenizer: no --model, "
                         "--workload repetitive")
            e2e_configs.write_dense_config(tmp, mtp_layers=1)
            args.model = tmp
        run(args)


def run(args: argparse.Namespace) -> None:
    rows = []
    for batch in [int(b) for b in args.batches.split(",")]:
        arms = [Arm(args.model, args.device, None, 0, batch, args)]
        for algo in ("ngram", "mtp"):
            for k in [int(x) for x in args.ks.split(",")]:
                modes = [m == "on" for m in args.mtp_graphs.split(",")] \
                    if algo == "mtp" else [True]
                overlaps = [m == "on" for m in args.overlap_verify.split(",")] \
                    if algo == "mtp" else [False]
                for fold, policy, graphs, ov in itertools.product(
                        (True, False) if args.unfolded else (True,),
                        args.policies.split(","), modes, overlaps):
                    arms.append(Arm(args.model, args.device, algo, k, batch, args, fold,
                                    policy, graphs, ov))
        for arm in arms:
            arm.setup()
        for r in range(args.rounds):  # each round in another order
            for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                arm.time_round()
        base = arms[0].finish()
        rows.append(base)
        for arm in arms[1:]:
            r = arm.finish()
            r.update(compare(base, r, args.tie_eps))
            r["speedup"] = r["decode_tok_s"] / base["decode_tok_s"]
            # the same round's two runs side by side: the median of their ratios
            r["paired_speedup"] = statistics.median(
                b / a for a, b in zip(r["round_step_s"], base["round_step_s"]))
            plain_s, v, d = base["step_s"], r["verify_step_s"], r["draft_s"]
            r["verify_x"] = (v - d) / plain_s if v and d is not None else None
            r["draft_x"] = d / arm.k / plain_s if d is not None else None
            rows.append(r)
        del arms
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    print(f"{'algo':10s} {'policy':8s} {'k':>2s} {'batch':>5s} {'tok/s':>9s} {'accept':>7s} "
          f"{'speedup':>7s} {'paired':>6s} {'verify_x':>8s} {'draft_x':>7s} {'verify%':>7s} "
          f"{'spread':>6s} same/near-tie/diff")

    def fmt(x, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    for r in rows:
        share = r.get("verify_share")
        print(f"{r['algo']:10s} {r['policy']:8s} {r['k']:2d} {r['batch']:5d} "
              f"{r['decode_tok_s']:9.1f} {fmt(r.get('acceptance_length'), '.2f'):>7s} "
              f"{r.get('speedup', 1.0):7.2f} {fmt(r.get('paired_speedup'), '.2f'):>6s} "
              f"{fmt(r.get('verify_x'), '.2f'):>8s} {fmt(r.get('draft_x'), '.2f'):>7s} "
              f"{fmt(share * 100 if share is not None else None, '.0f'):>7s} "
              f"{max(r['round_step_s']) / min(r['round_step_s']):6.2f} "
              f"{r.get('same', '-')}/{r.get('near_ties', '-')}/{r.get('diff', '-')}")
    for r in rows:  # what happened inside the timed run besides graph replays
        busy = {key: n for key, n in r["timed_counts"].items() if n}
        if busy:
            print(f"timed run of {r['algo']} {r['policy']} batch {r['batch']}: {busy}")
        if r["policy"] != "fixed" and r.get("timed_verify_share") is not None:
            print(f"timed runs of {r['algo']} {r['policy']} batch {r['batch']}: "
                  f"{r['timed_verify_share']:.0%} of decode steps verified, "
                  f"{r.get('switches')} switches, first steps {r.get('first_step_ms')} ms "
                  f"(in runs {r.get('policy_told_continuing_ms')}), policy's switch cost "
                  f"{r.get('policy_switch_cost_ms')} ms; its medians after the rounds "
                  f"{kept_medians(r)} ms, mean acceptance {r.get('policy_mean_acceptance')}")
        if r.get("chained_steps"):
            print(f"{r['algo']} {r['policy']} batch {r['batch']}: {r['chained_steps']} verify "
                  "steps chained (launched before the previous one landed), all runs")
    for r in rows:
        r.pop("tokens")
        r.pop("gaps")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
