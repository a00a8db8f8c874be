"""Checkpoints whose GDN heads remember far back, for tests where a stale state must show."""

from __future__ import annotations

import os

import torch


def slow_decay(path) -> None:
    """Make every GDN head remember far back (decay per token >= exp(-0.01)), so a wrong or
    stale restored state changes the tokens instead of being forgotten within a few tokens."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if name.endswith("A_log"):
            tensors[name] = torch.empty(t.shape).uniform_(0.001, 0.01, generator=gen).log()
        elif name.endswith("dt_bias"):
            tensors[name] = torch.full(t.shape, -2.0)
    save_file(tensors, file, metadata={"format": "pt"})


def slow_decay_checkpoint(directory, seed: int) -> str:
    """A tiny qwen3_5_text checkpoint (model.testing) in `directory`, made slow-decaying."""
    from deltaserve.model.testing import make_tiny_checkpoint

    path = make_tiny_checkpoint(directory, "qwen3_5_text", seed=seed)
    slow_decay(path)
    return str(path)
