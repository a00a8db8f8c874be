"""Prefill figures of issue 27 for bench_prefill.py and bench_e2e.py: time to first token of a
cold prompt, the forwards it took, and per forward the kernels launched, the host wall time and
the device time (is the prefill GPU bound?).

- ttft: wall time of `LLM.generate` of one cold prompt (prefix cache flushed), max_tokens 1;
  `forwards`: engine steps it ran (a 64n-token prompt took two before the track snapshot was
  written inside the forward).
- per forward (`prefill_forwards`): torch.profiler over the steps of one cold prompt: CUDA
  kernels (memcpy / memset excluded), of which Triton's (fla-core's, launched through
  cuLaunchKernelEx), the runtime's launch calls, the sum of kernel times (device time), and
  the wall time of the same steps without the profiler. device_share = device time / wall time:
  near 1 is GPU bound, far below 1 host bound.
"""

from __future__ import annotations

import statistics
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from deltaserve import SamplingParams

ONE = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
NOT_KERNELS = ("Memcpy", "Memset", "memcpy", "memset")
LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx",
                "hipLaunchKernel", "hipModuleLaunchKernel", "hipExtModuleLaunchKernel")


def _sync(eng) -> None:
    if eng.device.type == "cuda":
        torch.cuda.synchronize(eng.device)


def _steps_to_first_token(eng, ids: list[int]) -> int:
    eng.add_request(ids, ONE)
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    return steps


def ttft(llm, ids: list[int], runs: int = 5) -> dict:
    """Median and best wall seconds to the first token of `ids` (cold) and the forwards run."""
    eng = llm.engine
    walls, forwards = [], 0
    for _ in range(runs):
        eng.flush_cache()
        _sync(eng)
        t = time.perf_counter()
        forwards = _steps_to_first_token(eng, ids)
        _sync(eng)
        walls.append(time.perf_counter() - t)
    return {"ttft_s": statistics.median(walls), "ttft_best_s": min(walls), "forwards": forwards}


def prefill_forwards(llm, ids: list[int]) -> dict:
    """Kernels, launch calls, device time and wall time per forward of one cold prompt."""
    eng = llm.engine
    eng.flush_cache()
    _sync(eng)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        forwards = _steps_to_first_token(eng, ids)
        _sync(eng)
    kernels, device_us, launches = Counter(), 0.0, 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            if not e.name.startswith(NOT_KERNELS):
                kernels[e.name] += 1
                device_us += e.time_range.elapsed_us()
        elif e.name in LAUNCH_CALLS:
            launches += 1
    triton = sum(n for name, n in kernels.items() if _is_triton(name))
    eng.flush_cache()
    _sync(eng)
    t = time.perf_counter()
    _steps_to_first_token(eng, ids)
    _sync(eng)
    wall = time.perf_counter() - t
    total = sum(kernels.values())
    return {"forwards": forwards, "kernels_per_forward": total / forwards,
            "triton_kernels_per_forward": triton / forwards,
            "launch_calls_per_forward": launches / forwards,
            "kernels_per_layer": total / forwards / eng.model.config.num_hidden_layers,
            "device_s": device_us / 1e6, "wall_s": wall,
            "device_share": device_us / 1e6 / wall,
            "top_kernels": dict(kernels.most_common(25))}


VENDOR = ("nvjet", "sm90_", "sm80_", "ampere_", "cutlass", "cudnn", "gemm", "gemv", "cublas")


def _is_triton(name: str) -> bool:
    """fla-core's kernels (Triton) carry their Python function's name, a plain identifier;
    CUDA C++ kernels a demangled signature; vendor library kernels their own prefixes."""
    return name.isidentifier() and not name.startswith(VENDOR)


def report(name: str, t: dict, f: dict) -> str:
    """One table row: TTFT, forwards, kernels, device vs wall."""
    return (f"{name:12s} ttft {1e3 * t['ttft_s']:8.2f} ms (best {1e3 * t['ttft_best_s']:.2f}) "
            f"forwards {t['forwards']}  kernels/forward {f['kernels_per_forward']:7.1f} "
            f"({f['kernels_per_layer']:.1f}/layer, Triton {f['triton_kernels_per_forward']:.0f}, "
            f"launch calls {f['launch_calls_per_forward']:.0f})  device {1e3 * f['device_s']:.2f}"
            f" ms of {1e3 * f['wall_s']:.2f} ms wall ({100 * f['device_share']:.0f}%)")
