"""Random weights from config.json alone (`--load-format dummy`, vLLM's name for it).

For benchmarks of models whose checkpoints are not at hand or do not fit the disk: every
parameter is drawn on its own device, so a 35B-parameter model is ready in seconds on a GPU.
"""

from __future__ import annotations

import torch
from torch import nn

DUMMY_STD = 0.02  # transformers' initializer_range for these models: activations stay finite


@torch.no_grad()
def fill_dummy(model: nn.Module, seed: int, std: float = DUMMY_STD) -> None:
    """Fill every parameter of `model` in place with N(0, std²) draws (bias-free weights, norm
    weights and the GDN gate parameters alike), in `named_parameters` order from one generator
    on the parameters' device seeded with `seed`: the same seed, device and dtype give the same
    weights. Buffers are left as they are (the caller resets the rotary table)."""
    params = list(model.named_parameters())
    if not params:
        return
    gen = torch.Generator(device=params[0][1].device).manual_seed(seed)
    for _, p in params:
        p.normal_(0.0, std, generator=gen)
