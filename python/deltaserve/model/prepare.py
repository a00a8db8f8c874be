"""Load-time preparation of the weights the fused ops read in another form than the checkpoint.

Done once, after the checkpoint is copied in (`load_model` calls it), so no layer casts or
offsets a weight per call: zero-centred RMSNorms get their fp32 `rms_weight` = 1 + w
(ops/fused.py), GDN layers their fp32 `A_log` / `dt_bias` (the kernels' dtype). The projections
are already merged by then (model/merged.py: the loader fills each part's rows).
"""

from __future__ import annotations

from torch import nn

from deltaserve.model.gdn import GatedDeltaNet
from deltaserve.model.merged import MergedLinear
from deltaserve.model.norm import RMSNorm


def prepare_weights(model: nn.Module) -> None:
    """Derive every prepared weight of `model` from its parameters, in place (idempotent: run it
    again after editing a norm weight, A_log or dt_bias)."""
    for module in model.modules():
        if isinstance(module, (RMSNorm, GatedDeltaNet)):
            module.prepare()


def merged_layout(model: nn.Module) -> list[str]:
    """One line per distinct merged projection of `model`: `self_attn.qkv_proj = q_proj 64 |
    k_proj 32 | v_proj 32` (module path without the layer prefix)."""
    seen: dict[str, None] = {}
    for name, module in model.named_modules():
        if isinstance(module, MergedLinear):
            short = ".".join(p for p in name.split(".") if not p.isdigit()
                             and p not in ("layers", "mtp"))
            seen.setdefault(f"{short} = {module.layout()}")
    return list(seen)
