"""Applying a grammar's token bitmask to logits rows (structured output, engine/grammar.py).

One op, written in torch so that it runs as is on any device (a few element-wise kernels over
the masked rows, no extension kernel and no run-time compile): it is its own reference. The
bitmask layout is xgrammar's: int32 words, bit j of word w set = token 32 * w + j allowed.
"""

from __future__ import annotations

import torch


@torch.inference_mode()  # the engine's logits are inference tensors: written in place here
def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Set logits[r, t] = -inf for every token t that bitmask[r] disallows, for r in `rows`.

    logits [M, V] float (any device; written in place), bitmask [M, ceil(V / 32)] int32 (any
    device; words past V ignored), rows: distinct indices into M. Tokens past 32 * W are
    disallowed. Raises ValueError for mismatched shapes.
    """
    if not rows:
        return
    if logits.dim() != 2 or bitmask.dim() != 2 or bitmask.shape[0] != logits.shape[0]:
        raise ValueError(f"logits [M, V] and bitmask [M, W] must share M; got "
                         f"{tuple(logits.shape)} and {tuple(bitmask.shape)}")
    vocab = logits.shape[1]
    idx = torch.tensor(rows, dtype=torch.long)
    words = bitmask[idx].to(logits.device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).flatten(1).bool()  # [R, 32 W]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    idx = idx.to(logits.device)
    logits[idx] = logits[idx].masked_fill(~allowed[:, :vocab], float("-inf"))
