"""Host time of an engine step without the model: what the CPU does per decode / verify step.

TARGETS.md asks that scheduler + Python overhead per decode step stay under 10% of the GPU step
at batch 32; with overlap scheduling (engine/overlap.py) a plain decode step's host work runs
beside the GPU and only bounds the step when it is the longer of the two, while a verify step's
host work adds to it (the next verify needs this one's accepted counts). This runs the engine's
real step path on the CPU, the embedded default model, with the model compute stubbed: the
decode / verify graph runners and the MTP graph are built uncaptured (capture=False), then
each replay returns its first outputs again, and the verify commit (a GDN replay kernel on the
GPU) is a no-op. What remains is everything the host runs per step: scheduling, input staging
and attention metadata, sampling bookkeeping, the proposer's host work, draft acceptance,
token commit, stop checks, detokenization and the outputs. A CPU tensor op here stands for a
CUDA launch there (similar host cost, no device work), so this is a proxy for the GPU host's
time, not a GPU figure; the GPU step to compare with comes from bench_e2e.py / bench_spec.py.

Each figure is the best of three runs of `--max-tokens` steps for `batch` requests (prefill
steps excluded), in microseconds per step and per request row.

    python benchmarks/bench_step_host.py --out step_host.json
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import time

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.engine.cuda_graph import GraphRunner, hidden_ring_steps

# step kind -> engine arguments: plain decode (overlapped), or verify steps with k = 3 drafts
# (mtp_ov: MTP verify steps chained behind unlanded ones, --overlap-verify; no sync to replay,
# its host time runs beside the device's)
# (mtp_plain / ngram_plain: speculation on, the adaptive policy's every step forced plain:
# what being on costs a step that does not speculate, against "decode")
KINDS = {"decode": {}, "mtp": {"speculative_algorithm": "mtp"},
         "mtp_ov": {"speculative_algorithm": "mtp", "overlap_verify": True},
         "ngram": {"speculative_algorithm": "ngram"},
         "mtp_plain": {"speculative_algorithm": "mtp"},
         "ngram_plain": {"speculative_algorithm": "ngram"}}
PROMPT = "def f(x):\n    return x\n" * 8  # repetitive: the n-gram proposer finds drafts


class SyncClock:
    """Host time from each verify step's sync (its accepted tokens reach the host) to the next
    graph replay: on a GPU the device idles for that long (the host's critical path); what
    comes after a replay runs beside the device's work."""

    def __init__(self) -> None:
        self.synced: float | None = None
        self.gaps: list[float] = []

    def replay(self) -> None:
        if self.synced is not None:
            self.gaps.append(time.perf_counter() - self.synced)
            self.synced = None

    def timed_accept(self, accept):
        def wrapped(*args, **kwargs):
            out = accept(*args, **kwargs)
            self.synced = time.perf_counter()
            return out
        return wrapped


def stubbed_engine(kind: str, batch: int) -> LLM:
    """An LLM whose step graphs run no model after a warm-up step of `batch` requests
    (`llm.clock`: a SyncClock on its replays)."""
    spec = KINDS[kind]
    plain = kind.endswith("_plain")
    kw = dict(spec, speculative_num_steps=3,
              speculative_policy="adaptive" if plain else "fixed") if spec else {}
    llm = LLM(None, device="cpu", dtype="float32", enable_prefix_cache=False,
              max_running_reqs=max(batch, 8), **kw)
    eng = llm.engine
    rows = 4 if spec else 1
    if plain:
        eng.scheduler.choose_drafts = lambda reqs: 0
    eng.graphs = GraphRunner(eng.runner, max(batch, 8), rows, eng.max_model_len, capture=False)
    mtp = spec.get("speculative_algorithm") == "mtp"
    if mtp:
        eng.spec.use_graphs(max(batch, 8), eng.max_model_len, capture=False)
    if plain:  # the adaptive policy's plain decode steps, built as build_graph_runners does
        n = max(batch, 8)  # (after the MTP graphs: the hidden-state ring follows their bound)
        eng.decode_graphs = GraphRunner(eng.runner, n, 1, eng.max_model_len, capture=False,
                                        hidden_ring=hidden_ring_steps(eng.spec, eng.model, n))
    prompt = llm.tokenizer.encode(PROMPT, add_special_tokens=False)
    llm.generate([prompt] * batch, SamplingParams(temperature=0.0, max_tokens=8,
                                                  ignore_eos=True))
    graphs = list(eng.graphs.graphs.values())
    if plain:
        graphs += list(eng.decode_graphs.graphs.values())
    if mtp:
        graphs += list(eng.spec.proposer.graphs.graphs.values())
    llm.clock = SyncClock()
    for g in graphs:
        g.replay = llm.clock.replay  # the warm-up's outputs stay in the graph's output buffers
    eng.runner.commit_verify = lambda counts: None
    for g in eng.graphs.graphs.values():  # the commit a chained launch runs (overlap_verify)
        g.gdn.commit = lambda accepted, slot_ids: None
    if spec:
        eng.spec.accept = llm.clock.timed_accept(eng.spec.accept)
    llm.prompt = prompt
    return llm


def host_us_per_step(llm: LLM, batch: int, max_tokens: int,
                     prof: cProfile.Profile | None = None) -> tuple[float, float, float]:
    """Best of three: (µs of host time per decode / verify step of `batch` requests, µs of it
    from a verify step's sync to the next replay (SyncClock; 0 for decode), tokens committed
    per request per step). The stubbed graphs' outputs are stale, so a verify step commits
    what its warm-up outputs accept: compare kinds and commits per token too. `prof`, if
    given, is enabled over the timed steps only."""
    eng, best, best_gap = llm.engine, float("inf"), float("inf")
    for _ in range(3):
        for _ in range(batch):
            eng.add_request(list(llm.prompt), SamplingParams(
                temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
        while eng.scheduler.waiting or any(r.in_prefill for r in eng.scheduler.running):
            eng.step()
        llm.clock.gaps.clear()
        llm.clock.synced = None  # the prefill steps since the last sync are not a step's gap
        if prof is not None:
            prof.enable()
        n0, t0 = eng.num_steps, time.perf_counter()
        while eng.has_unfinished():
            eng.step()
        if prof is not None:
            prof.disable()
        steps = eng.num_steps - n0
        best = min(best, (time.perf_counter() - t0) / steps)
        gaps = llm.clock.gaps
        best_gap = min(best_gap, sum(gaps) / len(gaps) if gaps else 0.0)
    return best * 1e6, best_gap * 1e6, (max_tokens - 1) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--kinds", default=",".join(KINDS), help="comma-separated: " + ", ".join(KINDS))
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="step_host.json")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="print cProfile's N functions of most own time over each config's runs")
    args = ap.parse_args()
    torch.set_num_threads(1)  # host work is one thread; a GPU host runs no CPU kernels
    results = []
    for kind in args.kinds.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            llm = stubbed_engine(kind, batch)
            prof = cProfile.Profile() if args.profile else None
            us, gap, per_step = host_us_per_step(llm, batch, args.max_tokens, prof)
            if prof is not None:  # figures inflated by the profiler: compare within the run
                print(f"--- {kind} batch {batch}: own time, profiled")
                pstats.Stats(prof).sort_stats("tottime").print_stats(args.profile)
            results.append({"kind": kind, "batch": batch, "us_per_step": round(us, 1),
                            "us_per_request": round(us / batch, 2),
                            "us_sync_to_replay": round(gap, 1),
                            "tokens_per_step": round(per_step, 2)})
            print(f"{kind:7s} batch {batch:3d}: {us:7.0f} us per step ({gap:4.0f} from sync to "
                  f"replay), {us / batch:6.1f} us per request, {per_step:.2f} tokens per step")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
