"""snapshot_copy on CPU pools: every layer of each listed slot, nothing else."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import snapshot_copy


def _pools(slots, seed):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(3, slots, 2, 4, 4, generator=gen),
            torch.randn(3, slots, 3, 10, generator=gen).bfloat16())


def test_copies_every_layer_of_each_slot_and_nothing_else():
    src, dst = _pools(5, 0), _pools(7, 1)
    before = tuple(t.clone() for t in dst)
    snapshot_copy(src, torch.tensor([4, 1, 1]), dst, [2, 6, 3])
    for a, b, old in zip(src, dst, before, strict=True):
        assert torch.equal(b[:, 2], a[:, 4]) and torch.equal(b[:, 6], a[:, 1])
        assert torch.equal(b[:, 3], a[:, 1])
        assert torch.equal(b[:, [0, 1, 4, 5]], old[:, [0, 1, 4, 5]])


def test_mismatched_pools_or_slot_counts_raise():
    src, dst = _pools(5, 0), _pools(7, 1)
    with pytest.raises(ValueError, match="slots"):
        snapshot_copy(src, [1, 2], dst, [1])
    with pytest.raises(ValueError, match="pools differ"):
        snapshot_copy(src, [1], (dst[0].double(), dst[1]), [1])


@pytest.mark.parametrize("same_pool,src_slots,dst_slots,message", [
    (False, [1, 2], [3, 3], "listed twice"),
    (True, [1, 2], [2, 4], "both read and written"),  # 1 -> 2 while 2 -> 4: order decides
])
def test_copies_whose_result_would_depend_on_order_raise_and_copy_nothing(
        same_pool, src_slots, dst_slots, message):
    src = _pools(5, 0)
    dst = src if same_pool else _pools(5, 1)
    before = tuple(t.clone() for t in dst)
    with pytest.raises(ValueError, match=message):
        snapshot_copy(src, src_slots, dst, dst_slots)
    assert all(torch.equal(a, b) for a, b in zip(dst, before, strict=True))
