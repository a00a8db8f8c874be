"""Partial rotary position embedding (rotate-half form) on the leading `rotary_dim` channels.

Qwen3.5's multimodal RoPE (mrope sections) reduces to this when the temporal, height and width
positions are equal, which is the case for text-only input: every section reads the same
position, so `Qwen3_5TextRotaryEmbedding.recomposition_frequencies` is the identity.
"""

from __future__ import annotations

import torch
from torch import nn

from deltaserve.ops.fused import apply_rope  # noqa: F401  (the one implementation)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for absolute positions, computed on the fly (graph-capturable).

    inv_freq[i] = 1 / theta^(2i / rotary_dim), exactly as transformers'
    `compute_default_rope_parameters` (fp32 on CPU, then moved with the module).
    """

    def __init__(self, rotary_dim: int, theta: float) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.theta = theta
        self.register_buffer("inv_freq", self._inv_freq(), persistent=False)

    def _inv_freq(self) -> torch.Tensor:
        exponent = torch.arange(0, self.rotary_dim, 2, dtype=torch.float) / self.rotary_dim
        return 1.0 / (self.theta ** exponent)

    def reset_inv_freq(self) -> None:
        """Recompute `inv_freq` in place (after the module was materialised from meta)."""
        self.inv_freq = self._inv_freq().to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] int64 -> (cos, sin) [T, rotary_dim] in `dtype` (transformers casts too)."""
        freqs = positions[:, None].float() * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)
