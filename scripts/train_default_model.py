"""Train deltaserve's default model: a small Qwen3.5-style hybrid (3 GDN : 1 attention)
with one MTP layer, on Python source (the stdlib and permissively licensed packages), next-token +
MTP losses.

    python scripts/train_default_model.py --out build/default_model          # one H200
    python scripts/train_default_model.py --max-steps 5 --batch-size 2 --seq-len 128 \
        --eval-tokens 2048 --out /tmp/dm-smoke                                # CPU smoke run

Writes to --out: a Hugging Face folder (config.json, model.safetensors with mtp.* keys,
tokenizer files, README.md model card), train_log.json and loss.png (when matplotlib is
installed). Deterministic seed; bf16 autocast on CUDA, plain fp32 on CPU; the GDN layers run
`gdn_chunked.chunk_gated_delta_rule_torch` (torch, autograd) on both. Budget: at most 4000
steps x 128 x 1024 tokens of the stdlib split (twice per epoch) and the `extra` split of
permissively licensed packages (extra_corpus.py) when the corpus has one; after 60 steps the
tokens/s measured over steps 21..60 shrinks the step count to fit --max-minutes (default 8,
inside the device's 10-minute command limit), so the learning-rate schedule still decays to
its end. --stop-minutes / --resume split a longer run over several device calls (the
optimiser state stays in OUT/checkpoint.pt on the machine between them).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import signal
import sys
import time
from contextlib import ExitStack
from pathlib import Path

import torch

from deltaserve.default_model.build import FILES_DIR
from deltaserve.default_model.config import default_text_config
from deltaserve.default_model.corpus import load_manifest, prepare_corpus
from deltaserve.default_model.export import model_card, plot_losses, save_hf_folder
from deltaserve.default_model.gdn_chunked import causal_conv1d_shift, chunk_gated_delta_rule_torch
from deltaserve.default_model.hf_reference import causal_conv_override, torch_gdn_reference
from deltaserve.default_model.training import (
    TrainModel,
    evaluate,
    load_checkpoint,
    lr_at,
    make_optimizer,
    mix_streams,
    save_checkpoint,
    tokenize_split,
    train_batches,
    train_step,
)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command-line flags (see --help)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="build/default_model", help="output HF folder")
    ap.add_argument("--corpus", default="build/corpus", help="prepared corpus (made if absent)")
    ap.add_argument("--stdlib", default=None, help="stdlib dir when the corpus must be made")
    ap.add_argument("--token-cache", default=None, metavar="DIR",
                    help="keep the encoded splits here and reuse them (a resumed run)")
    ap.add_argument("--tokenizer", default=str(FILES_DIR), help="folder with tokenizer files")
    ap.add_argument("--max-steps", type=int, default=4000)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--micro-batches", type=int, default=1,
                    help="gradient accumulation slices per step (doubled on a first-step OOM)")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--stdlib-repeat", type=int, default=2,
                    help="copies of the stdlib training split per epoch beside the extra split")
    ap.add_argument("--no-extra", action="store_true",
                    help="train on the stdlib split only, even when the corpus has `extra`")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--mtp-steps", type=int, default=3, help="recursive MTP steps trained")
    ap.add_argument("--mtp-weight", type=float, default=0.5, help="x mean MTP step loss")
    ap.add_argument("--mtp-fraction", type=float, default=1.0,
                    help="share of each batch's rows the MTP losses train on (0 < f <= 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-every", type=int, default=250)
    ap.add_argument("--eval-tokens", type=int, default=0, help="held-out tokens (0 = all)")
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-minutes", type=float, default=8.0,
                    help="the training time the step count is fitted to (at step 60); the "
                         "loop also stops after this long, then evaluates and saves, except "
                         "in a resumed run, whose own start-up (a recompile) the fit did not "
                         "see: --stop-minutes bounds each call there")
    ap.add_argument("--stop-minutes", type=float, default=0.0, metavar="M",
                    help="after M minutes of training in this process, write OUT/checkpoint.pt "
                         "and exit with status 3 (the device's 10-minute command limit); rerun "
                         "the same command with --resume to go on")
    ap.add_argument("--final-seconds", type=float, default=0.0, metavar="S",
                    help="with --stop-minutes: the time the final evaluation and save need; a "
                         "run that could not fit them before its stop checkpoints before its "
                         "last step instead (the next call ends it)")
    ap.add_argument("--stop-step", type=int, default=0, metavar="N",
                    help="the same at step N (tests, reproducible splits)")
    ap.add_argument("--resume", action="store_true",
                    help="continue from OUT/checkpoint.pt (same flags as the run that wrote it)")
    ap.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--gdn-solve", default="trsm", choices=["trsm", "blocked"],
                    help="how the GDN chunk rule applies (I + A)^-1: one batched triangular "
                         "solve, or matmuls and a 16-step substitution (gdn_chunked.py)")
    ap.add_argument("--conv", default="conv1d", choices=["conv1d", "shift"],
                    help="the GDN layers' causal convolution: transformers' depthwise F.conv1d, "
                         "or W shifted multiply-adds that torch.compile fuses")
    ap.add_argument("--compile", default="none", metavar="BACKEND",
                    help="torch.compile the training forward (and so its backward) with this "
                         "backend: inductor fuses the elementwise work of the torch GDN chunk "
                         "rule, norms and gates (a cold compile: minutes); eager only traces "
                         "(tests); none: eager PyTorch")
    ap.add_argument("--profile-steps", type=int, default=0, metavar="N",
                    help="profile steps 6..5+N with torch.profiler, write the op table to "
                         "OUT/profile.txt and stop (no evaluation, nothing saved)")
    ap.add_argument("--arch", action="append", default=[], metavar="KEY=VALUE",
                    help="override an architecture entry, e.g. --arch hidden_size=64")
    args = ap.parse_args(argv)
    args.command = shlex.join(["python", "scripts/train_default_model.py", *(argv or sys.argv[1:])])
    return args


def arch_overrides(items: list[str]) -> dict:
    """Parse KEY=VALUE pairs; values are ints or floats."""
    out = {}
    for item in items:
        key, _, value = item.partition("=")
        out[key] = float(value) if any(c in value for c in ".e") else int(value)
    return out


PROFILE_AFTER = 5  # steps before --profile-steps starts (allocator and autotuning warm)


def start_profiler(device: torch.device) -> torch.profiler.profile:
    """A started torch.profiler over the CPU and, on CUDA, the device."""
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        torch.cuda.synchronize()
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    prof = torch.profiler.profile(activities=acts)
    prof.start()
    return prof


def write_profile(prof: torch.profiler.profile, device: torch.device, path: Path, steps: int,
                  tokens: int, t0: float) -> dict:
    """Stop `prof` (started at perf_counter `t0`, `steps` steps of `tokens` tokens in all ago),
    write its op table (by device time on CUDA) to `path`; return the profiled steps' wall
    seconds per step (profiler overhead included)."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    prof.stop()
    key = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    table = prof.key_averages().table(sort_by=key, row_limit=50)
    head = (f"{steps} steps profiled, {wall / steps:.3f} s a step, {tokens / wall:,.0f} "
            f"tokens/s (profiler on)\n")
    path.write_text(head + table)
    print(head + table, flush=True)
    return {"profile": str(path), "step_s": wall / steps}


def main(argv: list[str] | None = None) -> dict:
    """Train, evaluate, save; return the final held-out metrics."""
    args = parse_args(argv)
    device = torch.device("cuda" if args.device == "auto" and torch.cuda.is_available()
                          else "cpu" if args.device == "auto" else args.device)
    autocast = torch.bfloat16 if device.type == "cuda" else None
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    try:
        manifest = load_manifest(args.corpus)
    except FileNotFoundError:
        manifest = prepare_corpus(args.corpus, args.stdlib)
    tok_file = Path(args.tokenizer) / "tokenizer.json"
    stdlib_ids = tokenize_split(tok_file, args.corpus, "train", args.token_cache)
    extra_ids = (tokenize_split(tok_file, args.corpus, "extra", args.token_cache)
                 if "extra" in manifest["splits"] and not args.no_extra else None)
    train_ids = mix_streams(stdlib_ids, extra_ids, args.stdlib_repeat)
    held_ids = tokenize_split(tok_file, args.corpus, "heldout", args.token_cache)
    n_extra = 0 if extra_ids is None else extra_ids.numel()
    print(f"corpus: {stdlib_ids.numel() / 1e6:.2f} M stdlib x {args.stdlib_repeat} + "
          f"{n_extra / 1e6:.2f} M extra train tokens, {held_ids.numel() / 1e3:.0f} k "
          f"held-out tokens ({time.perf_counter() - t_start:.1f}s)", flush=True)
    log_corpus = {"stdlib_tokens": stdlib_ids.numel(), "extra_tokens": n_extra,
                  "stdlib_repeat": args.stdlib_repeat, "heldout_tokens": held_ids.numel()}

    torch.manual_seed(args.seed)
    model = TrainModel(default_text_config(**arch_overrides(args.arch)),
                       args.mtp_fraction).to(device)
    counts = model.param_counts()
    print(f"model: {counts['model'] / 1e6:.2f} M params + MTP {counts['mtp'] / 1e6:.2f} M, "
          f"device {device}, autocast {autocast}", flush=True)
    if args.compile != "none":  # the bound method: parameter names (the export) unchanged
        model.forward = torch.compile(model.forward, backend=args.compile)
    opt = make_optimizer(model, args.lr, args.weight_decay)
    eval_kw = dict(seq_len=args.seq_len, batch_size=args.batch_size, mtp_steps=args.mtp_steps,
                   autocast_dtype=autocast, max_tokens=args.eval_tokens)
    log = {"args": vars(args), "params": counts, "corpus": manifest, "tokens": log_corpus,
           "train": [], "eval": []}
    tokens_per_step = args.batch_size * args.seq_len
    ckpt, run_key = out / "checkpoint.pt", run_identity(args, manifest)
    step, trained_before = 0, 0.0
    if args.resume:
        meta = load_checkpoint(ckpt, model, opt, run_key)
        step, trained_before, log = meta["step"], meta["trained_s"], meta["log"]
        args.max_steps, args.micro_batches = meta["max_steps"], meta["micro_batches"]
        log.setdefault("resumed_at", []).append(step)
        print(f"resumed at step {step} of {args.max_steps} ({trained_before / 60:.1f} min "
              f"trained)", flush=True)
    batches = train_batches(train_ids, args.batch_size, args.seq_len, args.seed, skip=step)

    with ExitStack() as stack:
        # fla-core 0.6.0's gated backward is refused on Hopper with Triton < 3.7.1 (wrong
        # gradients, fla #640), and on CPU transformers binds fla's Triton kernels anyway
        stack.enter_context(torch_gdn_reference(
            chunk_fn=functools.partial(chunk_gated_delta_rule_torch, solve=args.gdn_solve)))
        if args.conv == "shift":
            stack.enter_context(causal_conv_override(causal_conv1d_shift, model))
        model.train()
        t_train, retry, t20 = time.perf_counter(), None, None
        t_step, step_s, signalled = t_train, 0.0, []
        # SIGTERM (the device script's guard on a call's time) checkpoints at the next step
        stack.callback(signal.signal, signal.SIGTERM,
                       signal.signal(signal.SIGTERM, lambda *_: signalled.append(True)))
        while step < args.max_steps:
            lr = lr_at(step, args.max_steps, args.lr, args.warmup, args.min_lr_ratio)
            if retry is None:
                batch = next(batches).to(device, non_blocking=True)
            retry = None
            try:
                r = train_step(model, opt, batch, lr=lr, mtp_steps=args.mtp_steps,
                               mtp_weight=args.mtp_weight, grad_clip=args.grad_clip,
                               autocast_dtype=autocast, micro_batches=args.micro_batches)
            except torch.cuda.OutOfMemoryError:
                # only the first step may retry: its update has not happened yet (AdamW's
                # state is made in step()), so halving the slice keeps the run's math
                if step or args.micro_batches * 2 > args.batch_size:
                    raise
                retry = batch
            if retry is not None:  # outside the except block: its frame held the activations
                opt.zero_grad(set_to_none=True)
                torch.cuda.empty_cache()
                args.micro_batches *= 2
                print(f"out of memory: --micro-batches {args.micro_batches}", flush=True)
                continue
            step += 1
            if args.profile_steps and step == PROFILE_AFTER:
                prof, prof_t0 = start_profiler(device), time.perf_counter()
            if args.profile_steps and step == PROFILE_AFTER + args.profile_steps:
                return write_profile(prof, device, out / "profile.txt", args.profile_steps,
                                     args.profile_steps * tokens_per_step, prof_t0)
            elapsed = trained_before + time.perf_counter() - t_train
            if step % args.log_every == 0 or step == args.max_steps:
                log["train"].append({"step": step, "loss": r.loss, "main": r.main, "mtp": r.mtp,
                                     "grad_norm": r.grad_norm, "lr": lr, "elapsed_s": elapsed})
                print(f"step {step:5d} loss {r.loss:.4f} main {r.main:.4f} "
                      f"mtp {[round(m, 3) for m in r.mtp]} lr {lr:.2e} {elapsed:.0f}s", flush=True)
            if step == 20 and not trained_before:
                t20 = elapsed
                print(f"throughput {20 * tokens_per_step / elapsed:,.0f} tokens/s (first 20 "
                      f"steps, with warm-up)", flush=True)
            if step == 60 and t20 is not None:
                # Shrink the run to the time budget while still in warmup, so the cosine decay
                # still ends at min_lr (a run cut by the clock alone would end at high lr); the
                # rate of steps 21..60 excludes start-up costs. The model card records the
                # step count; --max-steps N reproduces the run.
                rate = 40 / (elapsed - t20)
                fit = step + int(0.97 * (args.max_minutes * 60 - elapsed) * rate)
                print(f"throughput {rate * tokens_per_step:,.0f} tokens/s; {args.max_steps} "
                      f"steps would take {args.max_steps / rate / 60:.1f} min", flush=True)
                if fit < args.max_steps:
                    args.max_steps = max(fit, args.warmup + 1)
                    print(f"--max-minutes {args.max_minutes}: training {args.max_steps} steps",
                          flush=True)
            if step % args.eval_every == 0 and step < args.max_steps:
                log["eval"].append({"step": step, **evaluate(model, held_ids, **eval_kw)})
                print(f"eval step {step}: {log['eval'][-1]}", flush=True)
                (out / "train_log.json").write_text(json.dumps(log, indent=1))
            if not args.resume and elapsed > args.max_minutes * 60:
                print(f"stopping at step {step}: --max-minutes {args.max_minutes} reached")
                break
            now = time.perf_counter()
            step_s, t_step = now - t_step, now
            if step < args.max_steps and (step == args.stop_step or signalled or checkpoint_due(
                    step, args.max_steps, now - t_train, step_s, args.stop_minutes * 60,
                    args.final_seconds)):
                save_checkpoint(ckpt, model, opt, {
                    "run": run_key, "step": step, "max_steps": args.max_steps, "log": log,
                    "micro_batches": args.micro_batches, "trained_s": elapsed})
                print(f"checkpoint at step {step} of {args.max_steps}: {ckpt}; rerun with "
                      f"--resume to go on", flush=True)
                return {"checkpoint": str(ckpt), "step": step}
        train_seconds = trained_before + time.perf_counter() - t_train
        # the weights first: a call cut short in the evaluation still leaves them
        t = time.perf_counter()
        size = save_hf_folder(model, out, args.tokenizer)
        print(f"weights saved ({time.perf_counter() - t:.1f}s)", flush=True)
        t = time.perf_counter()
        final = evaluate(model, held_ids, **eval_kw)
    log["eval"].append({"step": step, **final})
    log["final"] = final
    print(f"held-out: loss {final['loss']:.4f} ppl {final['ppl']:.2f} "
          f"mtp {final['mtp_loss']} draft1 agreement {final['draft1_agreement']:.3f} "
          f"({time.perf_counter() - t:.1f}s)", flush=True)

    ckpt.unlink(missing_ok=True)
    cfg = model.lm.config
    arch = (f"{cfg.num_hidden_layers} layers ({cfg.layer_types.count('linear_attention')} Gated "
            f"DeltaNet, {cfg.layer_types.count('full_attention')} full attention), hidden "
            f"{cfg.hidden_size}, vocabulary {cfg.vocab_size}, one MTP layer")
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    (out / "train_log.json").write_text(json.dumps(log, indent=1))
    plotted = plot_losses(log, out / "loss.png")
    card = model_card({"corpus": manifest, "params": counts, "size_bytes": size,
                       "command": args.command, "steps": step, "tokens": step * tokens_per_step,
                       "seconds": train_seconds, "device": device_name, "final": final,
                       "config": arch, "curve": ("The loss curve is `loss.png`; " if plotted
                                                 else "") + "the log is `train_log.json`."})
    (out / "README.md").write_text(card)
    print(f"saved {out} ({size / 1e6:.1f} MB safetensors, plot {'yes' if plotted else 'no'}) "
          f"in {(time.perf_counter() - t_start) / 60:.1f} min", flush=True)
    return final


def checkpoint_due(step: int, max_steps: int, call_s: float, step_s: float, stop_s: float,
                   final_s: float) -> bool:
    """Whether a run with --stop-minutes (stop_s seconds; 0 = never) should checkpoint now,
    after `step` of `max_steps`, call_s seconds into this call's training, the last step having
    taken step_s: its time is up, or one more step would end the run too late for the final
    evaluation and save (final_s seconds) to fit before the stop."""
    if not stop_s:
        return False
    if call_s > stop_s:
        return True
    return step == max_steps - 1 and call_s + step_s + final_s > stop_s


def run_identity(args: argparse.Namespace, manifest: dict) -> dict:
    """What a checkpoint must share with the run that resumes it: every flag that changes
    the model, the data order or the schedule, and the corpus digest."""
    keys = ("arch", "batch_size", "seq_len", "stdlib_repeat", "no_extra", "lr", "min_lr_ratio",
            "warmup", "weight_decay", "grad_clip", "mtp_steps", "mtp_weight", "mtp_fraction",
            "seed", "max_minutes")
    return {**{k: getattr(args, k) for k in keys}, "corpus": manifest["sha256"],
            "extra": manifest.get("extra", {}).get("sha256")}


if __name__ == "__main__":
    sys.exit(3 if "checkpoint" in main() else 0)
