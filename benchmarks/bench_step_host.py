"""Host time of an engine step without the model: scheduler, sampling, speculation bookkeeping.

TARGETS.md asks that scheduler + Python overhead per decode step stay under 10% of the GPU step
at batch 32. This times `LLMEngine.step()` on the CPU with the model forward replaced by a stub
that does only the host work the CUDA-graph path does per step (input ids, positions and slots
as tensors, the padded attention metadata) and returns fixed logits; the verify commit (replay
kernels on the GPU) is a no-op. What remains is everything else the host runs per step:
scheduling, page bookkeeping, sampling (argmax over [rows, vocab] logits), token commit, stop
checks, detokenization, and with speculation the n-gram proposal and draft acceptance.
The GPU step time to compare with comes from bench_e2e.py (RESULTS.md); not measured here.

    python benchmarks/bench_step_host.py --out step_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.core import Phase
from deltaserve.engine.attention import PagedMetadata
from deltaserve.engine.model_runner import ForwardOutput


def stub_forward(engine, vocab: int):
    """runner.forward replacement: the graph path's host-side inputs, then fixed logits."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4096, vocab, generator=gen)
    runner = engine.runner

    def forward(batch, keep_hidden=False):
        rows = batch.rows_per_req if batch.phase is not Phase.PREFILL else 1
        n = batch.size
        ids = runner.input_ids(batch)
        torch.tensor(ids)
        torch.tensor([p for r in batch.reqs for p in range(r.device_len, r.device_len + rows)])
        torch.tensor([r.slot for r in batch.reqs], dtype=torch.int32)
        if batch.phase is not Phase.PREFILL:
            meta = PagedMetadata.allocate(n, rows, 2048, runner.kv.page_size,
                                          torch.device("cpu"))
            meta.fill([r.page_table for r in batch.reqs], [r.device_len for r in batch.reqs],
                      runner.kv.page_size)
            owners = [r for r in batch.reqs for _ in range(rows)]
        else:
            owners = [r for r, m in zip(batch.reqs, batch.extend_lens)
                      if r.device_len + m == r.prompt_len]
        return ForwardOutput(logits[:len(owners)], owners, None)

    return forward


def time_steps(llm: LLM, batch: int, prompt_len: int, max_tokens: int) -> list[float]:
    """Seconds of each decode/verify step of `batch` requests (prefill steps excluded)."""
    eng = llm.engine
    vocab = eng.model.config.vocab_size
    eng.runner.forward = stub_forward(eng, vocab)
    eng.runner.commit_verify = lambda committed: None
    eng.graphs = None
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request([(i * 7 + j) % (vocab - 1) + 1 for j in range(prompt_len)], params)
    times = []
    while eng.has_unfinished():
        prefill = any(r.in_prefill for r in eng.scheduler.running) or bool(eng.scheduler.waiting)
        t0 = time.perf_counter()
        eng.step()
        if not prefill:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default="step_host.json")
    args = ap.parse_args()
    results = {}
    for name, kw in (("decode", {}),
                     ("verify, ngram k=3", dict(speculative_algorithm="ngram",
                                                speculative_num_steps=3))):
        llm = LLM(None, device="cpu", dtype="float32", max_running_reqs=args.batch, **kw)
        times = time_steps(llm, args.batch, args.prompt_tokens, args.max_tokens)
        results[name] = {"steps": len(times), "median_ms": statistics.median(times) * 1e3,
                         "p90_ms": sorted(times)[int(0.9 * len(times))] * 1e3}
        print(f"{name:20s} batch {args.batch}: {results[name]['median_ms']:.2f} ms per step "
              f"(p90 {results[name]['p90_ms']:.2f}, {len(times)} steps)")
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
