"""Which op moves a run away from the transformers oracle: one prompt's first-token logprobs with
every kernel on, then with one ops module's kernels off at a time (its pure-torch reference runs
on the same device), fla's chunk prefill off, CUDA graphs off, and everything off, each beside
transformers in fp32 on the CPU.

    python scripts/bisect_ops.py --tiny qwen3_5_moe_text --seed 4 --dtype bfloat16 \
        --prompt-len 100 --prompt-seed 7 [--device cuda] [--out build/bisect.json]
    python scripts/bisect_ops.py --model DIR --prompt-ids 1,2,3 --dtype bfloat16

Per configuration it prints the first greedy token, the engine's logprob margin between the
reference's top two tokens (the reference's own margin is the first line) and the largest
|logprob - reference logprob| over the reference's top 20 tokens. A configuration whose error
collapses to the others' level names the op to look at. Written for the bf16 MoE GPU test that
picks another first token than the fp32 reference (benchmarks/RESULTS.md, "GPU tests").
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import sys
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

from deltaserve import LLM, SamplingParams
from deltaserve.model.testing import make_tiny_checkpoint, random_tokens, transformers_logits
from deltaserve.ops import _ext

OPS_MODULES = ("attention", "conv1d", "fused", "gdn", "linear", "moe_fused")  # every _ext user
TOP = 20


@contextlib.contextmanager
def kernels_off(names: tuple[str, ...]) -> Iterator[None]:
    """Ops modules `names` (under deltaserve.ops) see no extension: their references run."""
    off = types.SimpleNamespace(**{k: getattr(_ext, k) for k in dir(_ext)
                                   if not k.startswith("__")})
    off.use_extension = lambda *tensors: False
    with contextlib.ExitStack() as stack:
        for n in names:
            module = importlib.import_module(f"deltaserve.ops.{n}")
            stack.enter_context(mock.patch.object(module, "_ext", off))
        yield


@contextlib.contextmanager
def fla_off() -> Iterator[None]:
    """gdn_chunk_prefill runs its pure-torch reference on every device (wherever imported)."""
    from deltaserve.ops import chunk_prefill as cp

    orig = cp.gdn_chunk_prefill

    def ref(q, k, v, a, b, A_log, dt_bias, initial_state, index, scale, *, qk_normalized=False):
        return cp.gdn_chunk_prefill_ref(q, k, v, a, b, A_log, dt_bias, initial_state, index,
                                        scale, qk_normalized=qk_normalized)

    with contextlib.ExitStack() as stack:
        for name, module in list(sys.modules.items()):
            if name.startswith("deltaserve") and getattr(module, "gdn_chunk_prefill", None) is orig:
                stack.enter_context(mock.patch.object(module, "gdn_chunk_prefill", ref))
        yield


def configurations(device: str) -> list[tuple[str, contextlib.AbstractContextManager, dict]]:
    """(name, patch, extra LLM arguments) for every configuration run."""
    out = [("all kernels on", contextlib.nullcontext(), {})]
    out += [(f"{n} off", kernels_off((n,)), {}) for n in OPS_MODULES]
    if device != "cpu":
        out += [("fla prefill off", fla_off(), {}), ("cuda graphs off", contextlib.nullcontext(),
                                                      {"cuda_graphs": False})]
        out.append(("everything off", _everything_off(), {"cuda_graphs": False}))
    return out


@contextlib.contextmanager
def _everything_off() -> Iterator[None]:
    with kernels_off(OPS_MODULES), fla_off():
        yield


def first_token_logprobs(model: str, prompt: list[int], device: str, dtype: str,
                         extra: dict) -> tuple[int, dict[int, float]]:
    """The engine's first greedy token and its top-TOP logprobs {token: logprob}."""
    llm = LLM(model, device=device, dtype=dtype, num_pages=256, page_size=16, max_model_len=1024,
              **extra)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=TOP)
    (out,) = llm.generate([prompt], params)
    return out.token_ids[0], dict(out.logprobs[0].top)


def main(argv: list[str] | None = None) -> int:
    """Run every configuration; print one line each and write --out JSON when asked."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", help="HF checkpoint folder")
    ap.add_argument("--tiny", help="a tiny random checkpoint of this model type instead")
    ap.add_argument("--seed", type=int, default=4, help="the tiny checkpoint's seed")
    ap.add_argument("--prompt-ids", help="comma-separated token ids")
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--prompt-seed", type=int, default=7)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.tiny is None):
        ap.error("give one of --model and --tiny")
    tmp = tempfile.TemporaryDirectory()
    model = args.model or str(make_tiny_checkpoint(Path(tmp.name) / "m", args.tiny, args.seed))
    prompt = ([int(t) for t in args.prompt_ids.split(",")] if args.prompt_ids
              else random_tokens(args.prompt_len, args.prompt_seed))
    ref = torch.log_softmax(transformers_logits(model, torch.tensor(prompt))[-1], -1)
    top = torch.topk(ref, TOP).indices.tolist()
    a, b = top[0], top[1]
    print(f"reference fp32: first token {a}, margin {a} - {b} = {float(ref[a] - ref[b]):.4f}")
    rows = []
    for name, patch, extra in configurations(args.device):
        with patch:
            tok, lp = first_token_logprobs(model, prompt, args.device, args.dtype, extra)
        err = max(abs(lp[t] - float(ref[t])) for t in top if t in lp)
        margin = lp.get(a, float("-inf")) - lp.get(b, float("-inf"))
        rows.append(dict(config=name, token=tok, margin=margin, max_err=err))
        print(f"{name:>18}: first token {tok:>6}, margin {margin:+.4f}, max |dlogprob| {err:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(prompt=prompt, reference=dict(
            token=a, second=b, margin=float(ref[a] - ref[b])), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
