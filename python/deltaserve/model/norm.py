"""RMSNorm variants of Qwen3.5 / Qwen3-Next, over the fused ops of ops/fused.py.

The ops keep the rounding points of transformers' modules, so fp32 CPU outputs match it to
rounding and bf16 outputs match its bf16 path. Weights the ops read in another form than the
checkpoint's (fp32 1 + w) are derived once by `model.prepare.prepare_weights`, never per call.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops import fused
from deltaserve.ops.prologue import AddRMSNorm
from deltaserve.ops.prologue import GatedRMSNorm as GatedRMSNormInput


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x̂ · (1 + w), x̂ = x / sqrt(mean(x²) + eps).

    `weight` [dim] (model dtype) is the checkpoint's, zero-centred (zeros mean identity);
    `rms_weight` [dim] fp32 = 1 + weight, a non-persistent buffer set by `prepare()` (the loader
    calls it; call it again after editing `weight`). Matches transformers' `Qwen3_5RMSNorm`.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.register_buffer("rms_weight", torch.ones(dim), persistent=False)

    def prepare(self) -> None:
        """rms_weight <- 1 + weight in fp32 (what the unfused code computed every call)."""
        self.rms_weight = 1.0 + self.weight.detach().float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., dim] -> y, same shape and dtype."""
        return fused.rms_norm(x, self.rms_weight, self.eps)

    def add(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm of a residual block: s = residual + x, y = norm(s); x, residual [T, dim]
        -> (y, s), both [T, dim] in x's dtype (`fused.add_rms_norm`)."""
        return fused.add_rms_norm(x, residual, self.rms_weight, self.eps)

    def add_deferred(self, x: torch.Tensor, residual: torch.Tensor) -> AddRMSNorm:
        """`add` left to the projection that reads its output (`ops.prologue.AddRMSNorm`: y is
        made inside that projection's kernel where it fits; s is its `.sum` afterwards)."""
        return AddRMSNorm(x, residual, self.rms_weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: y = (w · x̂) · silu(z), per value head.

    x, z [T, HV, V] (z may be a strided view of the merged input projection) -> y [T, HV·V],
    dtype of x. `weight` [V] is NOT zero-centred (checkpoint ones mean identity) and is read as
    stored. Matches transformers' `Qwen3_5RMSNormGated` (`fused.gated_rms_norm`).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, z, self.weight, self.eps)

    def deferred(self, x: torch.Tensor, z: torch.Tensor) -> GatedRMSNormInput:
        """`forward` left to the projection that reads its output (out_proj: made inside its
        kernel where it fits, `ops.prologue.GatedRMSNorm`)."""
        return GatedRMSNormInput(x, z, self.weight, self.eps)
