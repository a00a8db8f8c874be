"""The CUDA kernels and their torch bindings, built for the CPU emulation of the device runtime.

`load()` compiles csrc/ops/{registry.cpp, gdn.cu, conv1d.cu, fused.cu, fused_gate.cu,
attention.cu, linear.cu, linear_prologue.cu, moe.cu} with the host compiler and -DDS_EMU
(csrc/emu/runtime.h: blocks in turn, a block's threads as fibers switched at barriers and warp
shuffles), once per checkout and source version (ninja, in build/emu/ of this checkout: torch's
shared extension cache, keyed by name only, let two checkouts rebuild over each other), and
registers the ops as `torch.ops.deltaserve_emu` on CPU tensors.
`emulate(monkeypatch)` then points deltaserve.ops' wrappers at them for CPU tensors, so a test
runs the kernels' code (indexing, staging, tiling, barriers) through the same wrappers the
engine uses. DS_EMU_REVERSE=1 resumes a block's threads last to first (.ci/run runs the tests
both ways). snapshot_copy is not emulated (its host side is CUDA copies and events).
"""

from __future__ import annotations

import functools
import os
import shutil
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SOURCES = [ROOT / "tests/csrc/emu" / f for f in ("registry_emu.cpp", "gdn_emu.cpp",
                                                  "conv1d_emu.cpp", "fused_emu.cpp",
                                                  "attention_emu.cpp", "linear_emu.cpp",
                                                  "moe_emu.cpp")]
FLAGS = [
    "-DDS_EMU=1",
    "-O1",  # -O0 fibers run ~3x slower; -O2 compiles ~2x longer for little more
    "-ffp-contract=off",  # fmul/fadd stay unfused, as __fmul_rn/__fadd_rn on the GPU
    "-Wno-unknown-pragmas",  # #pragma unroll
]


@functools.cache
def load():
    """Build (or take from the cache) and load the emulated op library; returns its namespace."""
    from torch.utils.cpp_extension import load as load_extension

    if shutil.which("ninja") is None:  # the test extra's ninja: off PATH in a venv not activated
        import ninja

        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    build = ROOT / "build" / "emu"
    build.mkdir(parents=True, exist_ok=True)
    load_extension(name="deltaserve_emu", sources=[str(s) for s in SOURCES],
                   build_directory=str(build),
                   extra_include_paths=[str(ROOT / "csrc")], extra_cflags=FLAGS,
                   is_python_module=False, verbose=False)
    return torch.ops.deltaserve_emu


class CountingOps:
    """The emulated op namespace, counting the calls made through it (so that a test can tell
    the kernels ran, not the reference the wrappers fall back to)."""

    def __init__(self, ops):
        self._ops, self.calls = ops, 0
        self.by_op: dict[str, int] = {}  # calls per op name

    def __getattr__(self, name):
        op = getattr(self._ops, name)

        def call(*args):
            self.calls += 1
            self.by_op[name] = self.by_op.get(name, 0) + 1
            return op(*args)

        return call


def emulate(monkeypatch) -> CountingOps:
    """Route deltaserve.ops' gdn, conv1d, fused, attention, linear and moe wrappers to the emulated
    kernels for CPU tensors; returns the namespace they now call."""
    from deltaserve.ops import _ext

    ops = CountingOps(load())
    monkeypatch.setattr(_ext, "use_extension", lambda *ts: all(t.device.type == "cpu" for t in ts))
    monkeypatch.setattr(_ext, "ops", lambda: ops)
    return ops
