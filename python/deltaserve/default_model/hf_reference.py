"""Make `transformers`' GDN models run on the CPU when fla-core is installed.

transformers binds its gated-delta-rule functions at import time: when the `fla` package is
importable, `torch_chunk_gated_delta_rule` / `torch_recurrent_gated_delta_rule` in the Qwen3.5 /
Qwen3-Next modeling modules become fla's Triton kernels, with no device check, so the same
model fails on CPU tensors ("0 active drivers"). The original pure-torch functions stay
reachable as the wrappers' `__wrapped__`. `torch_gdn_reference()` swaps them in for the
duration of a `with` block and restores the bound ones afterwards.

Used by the CPU tests, and by the training script on every device with `chunk_fn` =
`gdn_chunked.chunk_gated_delta_rule_torch` (fla-core's gated backward is refused on Hopper
with Triton < 3.7.1). Inference on CUDA leaves the fla kernels alone.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_MODULES = (
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "transformers.models.qwen3_next.modeling_qwen3_next",
)
_FUNCTIONS = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")


def _modeling_modules() -> Iterator[object]:
    """The modules of `_MODULES` this transformers has."""
    for mod_name in _MODULES:
        try:
            mod = importlib.import_module(mod_name)
        except ImportError:
            continue
        yield mod


@contextmanager
def torch_gdn_reference(chunk_fn: Callable | None = None) -> Iterator[None]:
    """Within the block, transformers' GDN layers use their pure-torch recurrence, or
    `chunk_fn` (same signature as `torch_chunk_gated_delta_rule`) for whole sequences.

    Mutates the module globals named in `_FUNCTIONS` of the modeling modules that exist and
    restores them on exit (also on error). Not thread-safe: do not nest across threads.
    """
    saved: list[tuple[object, str, object]] = []
    try:
        for mod in _modeling_modules():
            for fn_name in _FUNCTIONS:
                bound = getattr(mod, fn_name, None)
                original = getattr(bound, "__wrapped__", None)
                if chunk_fn is not None and fn_name == "torch_chunk_gated_delta_rule":
                    original = chunk_fn
                if bound is not None and original is not None:
                    saved.append((mod, fn_name, bound))
                    setattr(mod, fn_name, original)
        yield
    finally:
        for mod, fn_name, bound in reversed(saved):
            setattr(mod, fn_name, bound)


@contextmanager
def causal_conv_override(conv_fn: Callable, model: object | None = None) -> Iterator[None]:
    """Within the block, transformers' GDN layers run `conv_fn(x, weight, bias, activation)`
    (x [B, C, T], weight [C, W]; the signature of causal-conv1d's `causal_conv1d_fn`) for
    their whole-sequence causal convolutions instead of a depthwise `F.conv1d`.

    Newer transformers call the modeling module's global `causal_conv1d_fn`; older ones the
    `causal_conv1d_fn` attribute each GDN layer set at construction (None: `F.conv1d`), so
    the attributes of `model`'s modules that have one are replaced too. Both are restored on
    exit (also on error).
    """
    saved: list[tuple[object, str, object]] = []
    try:
        for mod in _modeling_modules():
            if hasattr(mod, "causal_conv1d_fn"):
                saved.append((mod, "causal_conv1d_fn", mod.causal_conv1d_fn))
                mod.causal_conv1d_fn = conv_fn
        for module in (model.modules() if model is not None else ()):
            if "causal_conv1d_fn" in vars(module):
                saved.append((module, "causal_conv1d_fn", module.causal_conv1d_fn))
                module.causal_conv1d_fn = conv_fn
        yield
    finally:
        for obj, name, old in reversed(saved):
            setattr(obj, name, old)
