"""End-to-end engine benchmark on a random-weight Qwen3.5-style model (TARGETS.md, "End to end").

Reports prefill tokens/s (one long prompt), decode tokens/s at batch 1 and 32, and the TTFT of a
cached follow-up turn against a cold prefill of the same prompt and a prefill of only its new
tokens. The anchor (transformers generating on the same weights) is measured in the same run
when --anchor is given. Prints a table and writes JSON.

    python benchmarks/bench_e2e.py --out e2e.json [--hidden 1024 --layers 24] [--anchor]
    python benchmarks/bench_e2e.py --model default --out e2e_default.json   # a given checkpoint
    python benchmarks/bench_e2e.py --config qwen3.6-35b-a3b --out e2e_35b.json  # dummy weights
    python benchmarks/bench_e2e.py --config qwen3-next-80b-a3b --layers 24 --out e2e_next.json
    python benchmarks/bench_e2e.py --long-context --out e2e_long.json   # decode at 128..32k
    python benchmarks/bench_e2e.py --vocab 248320 --step-only   # the 0.8B config's step figures

Every run also prints kernels per decode step and per layer, and the host gap per step, each
beside its target (step_kernels.py), then the host gap and decode tok/s with overlap scheduling
on and off at batch 1 and 32 beside the graph-bound tok/s (batch / graph device time per step);
--step-only prints only those (no prefill or decode runs).
Beside the TTFT of a 256-token prompt and the long prefill: the forwards each took, kernels per
prefill forward and the device's share of the wall time (prefill_kernels.py; bench_prefill.py
measures only those).
The defaults are the 0.8B config's shapes (issue 27) except the vocabulary: pass --vocab 248320.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path

import e2e_configs
import torch
from prefill_kernels import prefill_forwards  # a sibling script
from step_kernels import host_gap, kernels_per_step, overlap_table

from deltaserve import LLM, SamplingParams


def build_checkpoint(path: str, hidden: int, layers: int, vocab: int) -> int:
    """Random Qwen3.5-style checkpoint (3 GDN : 1 attention) in bf16; returns its parameters."""
    from transformers import Qwen3_5ForCausalLM

    cfg = e2e_configs.dense_config(hidden, layers, vocab)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen3_5ForCausalLM(cfg).to(torch.bfloat16)
    n_params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return n_params


def given_checkpoint(model: str) -> tuple[str, int, int]:
    """(folder, parameters without mtp.*, vocabulary) of --model ('default': embedded)."""
    from safetensors import safe_open

    from deltaserve.default_model import default_model_path
    from deltaserve.model.config import ModelConfig

    path = default_model_path() if model == "default" else model
    n_params = 0
    for f in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(f), "pt") as st:
            n_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys()
                            if not k.startswith("mtp."))
    return path, n_params, ModelConfig.from_pretrained(path).vocab_size


def timed(fn, *args, **kwargs) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def ttft(llm: LLM, ids: list[int], one: SamplingParams) -> float:
    """Seconds to the first token of a cold prompt (prefix cache flushed)."""
    llm.engine.flush_cache()
    return timed(llm.generate, [ids], one)


def prompt(n: int, vocab: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(vocab - 1) for _ in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None,
                    help="checkpoint folder, or 'default' for the embedded model, instead of "
                         "a random checkpoint of --hidden/--layers/--vocab")
    ap.add_argument("--config", default=None, choices=e2e_configs.CONFIGS,
                    help="a named MoE config with dummy weights (benchmarks/e2e_configs.py); "
                         "--layers cuts it, figures beside their rooflines")
    ap.add_argument("--reserve-gb", type=float, default=12.0, help="--config: GiB kept for "
                    "activations and graphs; the KV pool gets what the weights and states leave")
    ap.add_argument("--snapshot-slots", type=int, default=32, help="--config: GDN snapshot slots")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=None, help="default 24 (--config: all)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--prefill-tokens", type=int, default=8192)
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--anchor", action="store_true", help="also time transformers")
    ap.add_argument("--profile", action="store_true",
                    help="profile 8 decode steps at batch 1 and at batch 32 (with --step-only: "
                         "the step figures and these profiles alone)")
    ap.add_argument("--long-context", action="store_true",
                    help="only decode tok/s at long contexts (long_context_decode)")
    ap.add_argument("--step-only", action="store_true",
                    help="only the kernels per step and the host gap (fast)")
    ap.add_argument("--step-batches", default="1,32",
                    help="batch sizes of the overlap table (host gap and tok/s, overlap on "
                         "and off), comma-separated")
    ap.add_argument("--disable-overlap-schedule", action="store_true",
                    help="synchronous decode steps throughout (engine/overlap.py)")
    ap.add_argument("--out", default="e2e.json")
    ap.add_argument("--tensor-parallel-size", type=int, default=1,
                    help="ranks (one GPU each); --config's dummy weights are drawn at shard "
                         "size (a --model checkpoint is loaded whole on each GPU first)")
    args = ap.parse_args()
    if args.config is not None and (args.anchor or args.model is not None):
        ap.error("--config has dummy weights: no --anchor (transformers needs a checkpoint) "
                 "and no --model")
    if args.config is not None and args.prefill_tokens == 8192:
        args.prefill_tokens = 4096  # the prefill figure for the MoE configs
    res: dict = {"config": vars(args).copy()}
    with tempfile.TemporaryDirectory() as tmp:
        path = tmp
        kwargs = dict(device="cuda", dtype="bfloat16", kv_memory_gb=8.0, page_size=16,
                      chunk_size=8192, max_num_batched_tokens=8192, max_running_reqs=64)
        if args.config is not None:
            args.vocab = e2e_configs.write_config(path, args.config, args.layers)["vocab_size"]
            kwargs = e2e_configs.engine_kwargs(path, reserve_gb=args.reserve_gb,
                                               snapshot_slots=args.snapshot_slots)
            args.hidden = 0  # the config's own
        elif args.model is None:
            args.layers = args.layers or 24
            res["params"] = build_checkpoint(path, args.hidden, args.layers, args.vocab)
        else:
            path, res["params"], args.vocab = given_checkpoint(args.model)
            args.hidden = args.layers = 0  # not used: the checkpoint's own
        kwargs["tensor_parallel_size"] = args.tensor_parallel_size
        kwargs["overlap_schedule"] = not args.disable_overlap_schedule
        t_load = time.perf_counter()
        llm = LLM(path, **kwargs)
        if args.config is not None:
            res["load_s"] = time.perf_counter() - t_load
            res["params"] = sum(p.numel() for p in llm.engine.model.parameters())
            res.update(e2e_configs.rooflines(llm.engine.model, args.prefill_tokens, 256))
        batches = tuple(int(b) for b in args.step_batches.split(","))
        res.update(step_figures(llm, args.vocab, res["params"], batches))
        if args.step_only:
            if args.profile:
                res["profile"] = profile_tables(llm, args.vocab)
            report(res, args)
            return
        one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
        if args.long_context:
            res.update(long_context_decode(llm, args.vocab, args.decode_tokens))
            if args.profile:  # where the long context's extra step time goes (issue 28)
                for ctx in (128, 16384):
                    res[f"profile_ctx{ctx}_b8"] = table = profile_decode(llm, args.vocab, 8, ctx)
                    print(f"decode, batch 8, context {ctx}, 8 steps:\n{table}", flush=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=2)
            return
        long = prompt(args.prefill_tokens, args.vocab, 1)
        for _ in range(2):  # the first pass compiles fla-core's Triton kernels for these shapes
            res.update(prefill_protocol(llm, long, args.vocab, one))
        res["prefill_tok_s"] = args.prefill_tokens / res["prefill_s"]
        # each batch twice, the second pass timed: the first compiles fla-core's Triton
        # kernels for that batch's prefill shapes and captures its graphs; a compile inside
        # t_pre alone would shrink t_all - t_pre and inflate the figure (the default model's
        # batch-32 figure read 363k tok/s that way on 12-03)
        for batch in (1, 32, 1, 32):
            prompts = [prompt(128, args.vocab, 100 + i) for i in range(batch)]
            n = args.decode_tokens
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.engine.flush_cache()
            t_pre = timed(llm.generate, prompts, one)
            llm.engine.flush_cache()
            t_all = timed(llm.generate, prompts, params)
            res[f"decode_b{batch}_tok_s"] = batch * (n - 1) / max(t_all - t_pre, 1e-9)
        res["ttft_256_s"] = min(ttft(llm, prompt(256, args.vocab, 4 + i), one)
                                for i in range(3))
        # what a user's prompt meets: a length this process has not run (one-time costs per
        # shape, e.g. cuDNN's SDPA plans, 36 ms each on an H100: probe_sdpa_shapes.py)
        res["ttft_new_length_s"] = statistics.median(
            ttft(llm, prompt(n, args.vocab, 40 + n), one) for n in (241, 243, 245))
        res.update(prefill_launch_figures(llm, args.vocab, args.prefill_tokens))
        if args.profile:
            res["profile"] = profile_tables(llm, args.vocab)
        del llm
        torch.cuda.empty_cache()
        report(res, args)  # before the anchor: a run cut short keeps deltaserve's figures
        if args.config is not None:
            e2e_configs.report(res)
        if args.anchor:
            res.update(anchor(path, args))
            report(res, args)


def prefill_launch_figures(llm: LLM, vocab: int, long: int) -> dict:
    """Forwards, kernels per forward and the device's share of the wall time of a cold
    256-token prompt and of the `long` prefill (prefill_kernels.py)."""
    out = {}
    for name, n in (("256", 256), ("long", long)):
        f = prefill_forwards(llm, prompt(n, vocab, 4))
        for key in ("forwards", "kernels_per_forward", "triton_kernels_per_forward",
                    "device_share"):
            out[f"prefill_{name}_{key}"] = f[key]
    return out


def step_figures(llm: LLM, vocab: int, n_params: int,
                 batches: tuple[int, ...] = (1, 32)) -> dict:
    """Kernels per decode step and host gap at batch 1 as configured (overlap scheduling on
    unless --disable-overlap-schedule), then host gap and decode tok/s beside the graph's
    device-bound tok/s with overlap on and off at each of `batches` (step_kernels.py), with the
    weight-read roofline of a batch-1 step (bf16 weights once / 4,274 GB/s)."""
    eng = llm.engine
    out = kernels_per_step(eng, vocab)
    out.update(host_gap(eng, vocab))
    if eng.graphs is not None:
        out["overlap_table"] = overlap_table(eng, vocab, batches)
    out["roofline_step_s"] = 2 * n_params / 4274e9
    names = out.pop("kernel_names")
    print("kernels in one decode step (name: count):", flush=True)
    for name, n in names.items():
        print(f"  {n:4d}  {name[:110]}")
    return out


def report(res: dict, args) -> None:
    """Print the figures measured so far and write them to --out."""
    print(f"model: {res['params'] / 1e6:.1f}M params, {args.model or 'random'}, hidden "
          f"{args.hidden or '-'}, {args.layers or '-'} layers", flush=True)
    layers = res.get("kernels_per_step", 0) / max(res.get("kernels_per_layer", 1), 1e-9)
    if "kernels_per_step" in res:
        print(f"{'kernels_per_step':28s} {res['kernels_per_step']} (target <= "
              f"{14 * round(layers)}: 14 a layer)")
        print(f"{'kernels_per_layer':28s} {res['kernels_per_layer']:.1f} (target <= 14)")
        print(f"{'step_wall_s':28s} {res['step_wall_s']:.4g} (weight-read roofline "
              f"{res['roofline_step_s']:.4g})")
        print(f"{'step_device_s':28s} {res['step_device_s']:.4g}")
        print(f"{'host_gap_s':28s} {res['host_gap_s']:.4g} ({100 * res['host_gap_share']:.1f}% "
              f"of the step; target <= 5%; overlap {'on' if res.get('overlap') else 'off'})",
              flush=True)
    for key, r in res.get("overlap_table", {}).items():
        print(f"{'host_gap_' + key:28s} {r['host_gap_s']:.4g} ({100 * r['host_gap_share']:.1f}%"
              f"); decode {r['tok_s']:.0f} tok/s, graph-bound {r['device_tok_s']:.0f} tok/s",
              flush=True)
    for key in ("prefill_tok_s", "decode_b1_tok_s", "decode_b32_tok_s", "ttft_256_s",
                "ttft_new_length_s",
                "prefill_256_forwards", "prefill_256_kernels_per_forward",
                "prefill_256_triton_kernels_per_forward", "prefill_256_device_share",
                "prefill_long_forwards", "prefill_long_kernels_per_forward",
                "prefill_long_device_share", "ttft_followup_s",
                "prefill_new_only_s", "ttft_cold_s", "followup_cached_tokens",
                "anchor_decode_b1_tok_s", "anchor_decode_b32_tok_s", "anchor_prefill_s"):
        if key in res:
            print(f"{key:28s} {res[key]:.4g}", flush=True)
    with open(args.out, "w") as f:
        json.dump(res, f, indent=2)


def prefill_protocol(llm: LLM, long: list[int], vocab: int, one: SamplingParams) -> dict:
    """Cold prefill of `long`; then a follow-up turn (long + answer + 256 new tokens) timed
    against the same prompt cold and against a prefill of only its uncached tokens."""
    res = {}
    llm.engine.flush_cache()
    res["prefill_s"] = timed(llm.generate, [long], one)
    (a1,) = llm.generate([long], SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    follow = long + a1.token_ids + prompt(256, vocab, 2)
    torch.cuda.synchronize()
    t = time.perf_counter()
    (out,) = llm.generate([follow], one)
    torch.cuda.synchronize()
    res["ttft_followup_s"] = time.perf_counter() - t
    res["followup_cached_tokens"] = out.cached_tokens
    new_only = prompt(len(follow) - out.cached_tokens, vocab, 3)
    llm.engine.flush_cache()
    res["prefill_new_only_s"] = timed(llm.generate, [new_only], one)
    llm.engine.flush_cache()
    res["ttft_cold_s"] = timed(llm.generate, [follow], one)
    return res


def profile_tables(llm: LLM, vocab: int) -> dict[str, str]:
    """profile_decode's table at batch 1 and 32, each printed; {"b1": table, "b32": table}."""
    out = {}
    for batch in (1, 32):
        out[f"b{batch}"] = profile_decode(llm, vocab, batch)
        print(f"decode, batch {batch}, 8 steps:\n{out[f'b{batch}']}")
    return out


def profile_decode(llm: LLM, vocab: int, batch: int = 1, ctx: int = 128) -> str:
    """torch.profiler table of 8 decode steps of `batch` requests of `ctx`-token prompts (after
    their prefill)."""
    from torch.profiler import ProfilerActivity, profile

    eng = llm.engine
    rids = {eng.add_request(prompt(ctx, vocab, 5 + i),
                            SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True))
            for i in range(batch)}
    started: set[int] = set()
    while started != rids:  # past every prompt's prefill
        started |= {o.rid for o in eng.step() if o.new_token_ids}
    eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(8):
            eng.step()
        torch.cuda.synchronize()
    while eng.has_unfinished():
        eng.step()
    return prof.key_averages().table(sort_by="self_device_time_total", row_limit=40)


LONG_CONTEXT_CASES = ((128, 1), (16384, 1), (128, 8), (16384, 8), (128, 4), (32768, 4))


def long_context_decode(llm: LLM, vocab: int, n: int) -> dict:
    """Decode tok/s of `batch` requests whose prompts hold `ctx` tokens, for each case of
    LONG_CONTEXT_CASES (each long case beside the 128-token case of its batch), and the graph
    runner's counts of decode steps run through a graph and run eagerly (0 at every length:
    the graphs read lengths from device tensors). Prints one line per case.

    The rate is timed over the decode steps alone (`decode_after_prefill`): from the call
    after which every request has its first token to the last. (Until 12-05 it was all of a
    run minus a separate prefill-only run: at 8 x 16k tokens the prefill is about 2x the
    decode time, so its run-to-run spread moved the decode figure by tens of percent, and
    decode steps that ran between other requests' prefill chunks counted at a smaller batch;
    both ran side by side on 12-05, RESULTS.md.)"""
    res = {}
    params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
    graphs = llm.engine.graphs
    for ctx, batch in (LONG_CONTEXT_CASES[0],) + LONG_CONTEXT_CASES:  # the first: warm-up
        prompts = [prompt(ctx, vocab, 1000 + i) for i in range(batch)]
        llm.engine.flush_cache()
        before = (graphs.graph_steps, graphs.eager_steps) if graphs else (0, 0)
        key = f"decode_ctx{ctx}_b{batch}"
        res[f"{key}_tok_s"] = decode_after_prefill(llm.engine, prompts, params)
        if graphs:
            res[f"{key}_graph_steps"] = graphs.graph_steps - before[0]
            res[f"{key}_eager_steps"] = graphs.eager_steps - before[1]
        base = res.get(f"decode_ctx128_b{batch}_tok_s")
        ratio = f"{res[f'{key}_tok_s'] / base:.2f}x of ctx 128" if base and ctx > 128 else ""
        print(f"{key:24s} {res[f'{key}_tok_s']:9.1f} tok/s  graph steps "
              f"{res.get(f'{key}_graph_steps', '-')}, eager {res.get(f'{key}_eager_steps', '-')}"
              f"  {ratio}", flush=True)
    return res


def decode_after_prefill(engine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Tokens per second of the steps after every request of `prompts` has its first token:
    the engine's step loop, timed from the call that delivered the last first token (its GPU
    work synchronised) to the end; tokens counted as they are delivered."""
    rids = {engine.add_request(list(p), params) for p in prompts}
    started: set[int] = set()
    while started != rids:
        started |= {o.rid for o in engine.step() if o.new_token_ids}
    torch.cuda.synchronize()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished():
        tokens += sum(len(o.new_token_ids) for o in engine.step())
    torch.cuda.synchronize()
    return tokens / max(time.perf_counter() - t0, 1e-9)


def anchor(path: str, args) -> dict:
    """transformers on the same weights (with fla-core kernels when importable)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).cuda().eval()
    out = {}
    with torch.inference_mode():
        ids = torch.tensor([prompt(args.prefill_tokens, args.vocab, 1)], device="cuda")
        model(ids[:, :256])
        out["anchor_prefill_s"] = timed(model, ids)
        for batch in (1, 32):
            x = torch.tensor([prompt(128, args.vocab, 100 + i) for i in range(batch)],
                             device="cuda")
            n = 32
            gen = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
            t1 = timed(model.generate, x, max_new_tokens=1, min_new_tokens=1, **gen)
            tn = timed(model.generate, x, max_new_tokens=n, min_new_tokens=n, **gen)
            out[f"anchor_decode_b{batch}_tok_s"] = batch * (n - 1) / (tn - t1)
    return out


if __name__ == "__main__":
    main()
