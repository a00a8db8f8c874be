"""Position-independent transcendental functions for the CPU references.

ATen's CPU kernels evaluate exp/log1p/sigmoid/rsqrt with SIMD code on full vectors and with
scalar libm code on the tail of each contiguous run (and of each thread's share), and the two
can differ in the last bit. So the same value could round differently in a decode batch of 3
than in a verify batch of 12, which would break the bitwise decode/verify/replay contract.
`pointwise` runs `fn` on a flat copy padded to whole vectors, in pieces small enough for one
thread, so every element takes the SIMD path whatever its position.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

_ALIGN = 64  # elements; a multiple of 2 x the widest vector (AVX-512: 16 floats)
_PIECE = 16384  # below ATen's parallel grain size (32768): one thread, no split tails


def pointwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn(x) elementwise, with results that do not depend on x's shape or an element's position."""
    if x.device.type != "cpu":
        return fn(x)
    flat = x.reshape(-1)
    n = flat.numel()
    padded = F.pad(flat, (0, (-n) % _ALIGN))
    out = torch.cat([fn(p) for p in padded.split(_PIECE)]) if n else fn(padded)
    return out[:n].reshape(x.shape)
