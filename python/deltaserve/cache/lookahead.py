"""Lookahead radix keys: position i keyed by the pair (t_i, t_{i+1}).

Needed when cached KV depends on the next token too: an MTP head's draft KV at position i is
computed from t_{i+1} (DESIGN.md, "Lookahead keys"). A sequence of n tokens yields n-1 keys, so
a cached path is matched at a position only when the token after it agrees; a GDN snapshot at
depth L is then reused only when t_L agrees as well.
"""

from __future__ import annotations

_SHIFT = 32
_MASK = (1 << _SHIFT) - 1


def lookahead_keys(ids: list[int]) -> list[int]:
    """[t_0 .. t_{n-1}] -> [pack(t_0, t_1) .. pack(t_{n-2}, t_{n-1})] (n-1 int64 keys).

    Raises ValueError for a token id outside [0, 2^31) (it would not pack into an int64).
    """
    for t in ids:
        if not 0 <= t <= _MASK >> 1:
            raise ValueError(f"token id {t} does not fit a lookahead key")
    return [(a << _SHIFT) | b for a, b in zip(ids, ids[1:])]
