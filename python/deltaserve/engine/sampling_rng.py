"""Counter-based random numbers for sampling: one uniform per (seed, output position).

A request's draw for its output token at position p (0 = the first generated token) is a pure
function of (seed, p): the p-th output of SplitMix64 (Steele, Lea & Flood, "Fast splittable
pseudorandom number generators", OOPSLA 2014; the finaliser is Stafford's "Mix13") started
from the state splitmix64(seed). There is no generator object per request and no state to
carry, so
- a request's tokens do not depend on which other requests share its batch, nor on the order
  rows are sampled in;
- a verify row j (position len(output) + j) draws exactly what the j-th later decode step
  would, whether or not the rows before it are accepted;
- the integer part is bit-identical on every device (torch int64 arithmetic wraps mod 2**64
  on CPU and CUDA; `splitmix64_int` is the pure-Python oracle).

torch has no unsigned 64-bit shift, so `x >>> s` is written `(x >> s) & (2**(64-s) - 1)`.
"""

from __future__ import annotations

import torch

MASK64 = (1 << 64) - 1
GOLDEN = 0x9E3779B97F4A7C15  # 2**64 / golden ratio, SplitMix64's state increment
MIX1 = 0xBF58476D1CE4E5B9
MIX2 = 0x94D049BB133111EB
UNIFORM_BITS = 24  # fp32's significand: every u = n * 2**-24 is exact, and u <= 1 - 2**-24


def to_int64(x: int) -> int:
    """An integer taken mod 2**64, as the signed int64 with the same bits (a seed in
    [-2**63, 2**64) -> [-2**63, 2**63))."""
    x &= MASK64
    return x - (1 << 64) if x >> 63 else x


def splitmix64_int(x: int) -> int:
    """SplitMix64's output for state x before the increment (pure Python, unsigned result)."""
    z = (x + GOLDEN) & MASK64
    z = ((z ^ (z >> 30)) * MIX1) & MASK64
    z = ((z ^ (z >> 27)) * MIX2) & MASK64
    return z ^ (z >> 31)


def uniform_int(seed: int, position: int) -> float:
    """`row_uniforms` for one row, in pure Python: the oracle of the tensor version."""
    z = splitmix64_int((splitmix64_int(seed & MASK64) + position * GOLDEN) & MASK64)
    return (z >> (64 - UNIFORM_BITS)) * 2.0 ** -UNIFORM_BITS


def _srl(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)


def splitmix64(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64 of int64 x (any shape, any device) -> int64 of the same shape: the bits of
    `splitmix64_int` of x's bits, read as signed."""
    z = x + to_int64(GOLDEN)
    z = (z ^ _srl(z, 30)) * to_int64(MIX1)
    z = (z ^ _srl(z, 27)) * to_int64(MIX2)
    return z ^ _srl(z, 31)


def row_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) per row. seeds, positions: int64 [R] (seeds as `to_int64` of the
    request's seed) -> fp32 [R], multiples of 2**-24, at most 1 - 2**-24.

    u = top 24 bits of splitmix64(splitmix64(seed) + position * GOLDEN) * 2**-24, i.e. the
    position-th number of the SplitMix64 stream whose state starts at splitmix64(seed)
    (hashing the seed first keeps the streams of seeds s and s + 1 apart).
    """
    z = splitmix64(splitmix64(seeds) + positions * to_int64(GOLDEN))
    return _srl(z, 64 - UNIFORM_BITS).to(torch.float32) * 2.0 ** -UNIFORM_BITS
