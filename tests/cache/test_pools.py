"""PagePool and GDNStatePool: ids handed out, double frees, integrity, slot copies."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.page_pool import PagePool
from deltaserve.cache.state_pool import GDNStatePool


def make_state_pool(num_slots: int = 5) -> GDNStatePool:
    # L=2 layers, HV=3 value heads, V=4, K=5, D=6 conv channels, W=4
    return GDNStatePool(2, num_slots, 3, 4, 5, 6, 4, "cpu", torch.bfloat16)


def test_page_zero_is_never_handed_out_and_every_other_page_is():
    pool = PagePool(8, page_size=16)
    pages = pool.allocate(7)
    assert sorted(pages) == list(range(1, 8))
    assert pool.num_free == 0 and not pool.can_allocate(1)
    pool.check_integrity()


def test_allocating_more_pages_than_are_free_is_an_assertion():
    pool = PagePool(4, page_size=1)
    assert pool.can_allocate(3) and not pool.can_allocate(4)
    with pytest.raises(AssertionError):
        pool.allocate(4)
    assert pool.num_free == 3


def test_a_double_free_of_a_page_is_caught_and_frees_nothing():
    pool = PagePool(6, page_size=4)
    a, b = pool.allocate(2)
    pool.free([a])
    with pytest.raises(AssertionError):
        pool.free([b, a])
    with pytest.raises(AssertionError):
        pool.free([b, b])
    with pytest.raises(AssertionError):
        pool.free([0])
    assert pool.is_allocated(b) and pool.num_free == 4
    pool.check_integrity()


def test_freed_pages_are_reused_only_after_the_other_free_pages():
    pool = PagePool(5, page_size=1)
    (first,) = pool.allocate(1)
    pool.free([first])
    assert pool.allocate(4)[-1] == first


def test_page_pool_integrity_catches_a_page_both_free_and_allocated():
    pool = PagePool(4, page_size=1)
    pages = pool.allocate(2)
    pool._free.append(pages[0])  # corrupt on purpose
    with pytest.raises(AssertionError, match="both free and allocated"):
        pool.check_integrity()


def test_state_pool_tensors_have_the_documented_shapes_and_dtypes():
    pool = make_state_pool()
    assert pool.recurrent.shape == (2, 5, 3, 4, 5) and pool.recurrent.dtype == torch.float32
    assert pool.conv.shape == (2, 5, 3, 6) and pool.conv.dtype == torch.bfloat16
    assert pool.bytes_per_slot == 2 * (3 * 4 * 5 * 4 + 3 * 6 * 2)
    pool.check_integrity()


def test_slot_zero_is_never_handed_out_and_a_double_free_is_caught():
    pool = make_state_pool(num_slots=3)
    slots = [pool.allocate(), pool.allocate()]
    assert sorted(slots) == [1, 2] and not pool.can_allocate(1)
    with pytest.raises(AssertionError):
        pool.allocate()
    pool.free(slots[0])
    with pytest.raises(AssertionError):
        pool.free(slots[0])
    with pytest.raises(AssertionError):
        pool.free(0)
    pool.check_integrity()


def test_copy_moves_every_layer_of_both_states_and_leaves_the_source_and_others_alone():
    pool = make_state_pool()
    src, dst, other = pool.allocate(), pool.allocate(), pool.allocate()
    gen = torch.Generator().manual_seed(0)
    pool.recurrent.copy_(torch.randn(pool.recurrent.shape, generator=gen))
    pool.conv.copy_(torch.randn(pool.conv.shape, generator=gen))
    before = pool.recurrent.clone(), pool.conv.clone()
    pool.copy(src, dst)
    for now, old in zip((pool.recurrent, pool.conv), before, strict=True):
        assert torch.equal(now[:, dst], old[:, src])
        assert torch.equal(now[:, src], old[:, src])
        assert torch.equal(now[:, other], old[:, other])
        assert torch.equal(now[:, 0], old[:, 0])


def test_zero_clears_one_slot_of_every_layer():
    pool = make_state_pool()
    a, b = pool.allocate(), pool.allocate()
    pool.recurrent.fill_(1.0)
    pool.conv.fill_(1.0)
    pool.zero(a)
    assert not pool.recurrent[:, a].any() and not pool.conv[:, a].any()
    assert pool.recurrent[:, b].all() and pool.conv[:, b].all()


def test_copy_and_zero_refuse_slots_that_are_not_allocated():
    pool = make_state_pool()
    a = pool.allocate()
    with pytest.raises(AssertionError):
        pool.copy(a, 3)
    with pytest.raises(AssertionError):
        pool.zero(3)


@pytest.mark.gpu
def test_copy_and_zero_work_on_a_cuda_pool():
    pool = GDNStatePool(2, 4, 3, 4, 5, 6, 4, "cuda", torch.bfloat16)
    src, dst = pool.allocate(), pool.allocate()
    pool.recurrent.normal_()
    pool.conv.normal_()
    pool.copy(src, dst)
    torch.cuda.synchronize()
    assert torch.equal(pool.recurrent[:, dst], pool.recurrent[:, src])
    assert torch.equal(pool.conv[:, dst], pool.conv[:, src])
    pool.zero(src)
    assert not pool.recurrent[:, src].any() and pool.recurrent[:, dst].any()
