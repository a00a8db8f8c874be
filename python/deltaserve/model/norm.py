"""RMSNorm variants of Qwen3.5 / Qwen3-Next.

Both compute in fp32 and cast back at the same points as transformers, so fp32 CPU outputs
match it to rounding and bf16 outputs match its bf16 path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """Zero-centred RMSNorm: y = x̂ · (1 + w), x̂ = x / sqrt(mean(x²) + eps).

    x [..., dim] any float dtype -> y same shape and dtype. `weight` [dim] is stored zero-centred
    (a checkpoint's zeros mean identity). Matches transformers' `Qwen3_5RMSNorm.forward`
    (modeling_qwen3_5.py): normalise in fp32, multiply by (1 + w) in fp32, then cast.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """The GDN output norm: y = (w · x̂) · silu(z), per value head.

    x, z [..., head_v_dim] -> y same shape, dtype of x. `weight` [head_v_dim] is NOT zero-centred
    (checkpoint ones mean identity). Matches transformers' `Qwen3_5RMSNormGated.forward`:
    x̂ in fp32, cast to x's dtype before the weight, gate in fp32, cast at the end.
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        y = self.weight * y.to(dtype)
        return (y * F.silu(z.float())).to(dtype)
