"""HostSnapshotBank: host slot ids, double frees, integrity, store/load of whole GDN states."""

from __future__ import annotations

import pytest
import torch

from deltaserve.cache.host_bank import BankUsage, HostSnapshotBank
from deltaserve.cache.state_pool import GDNStatePool


def make_pool(num_slots: int = 5, device: str = "cpu") -> GDNStatePool:
    # L=2 layers, HV=3 value heads, V=4, K=5, D=6 conv channels, W=4
    return GDNStatePool(2, num_slots, 3, 4, 5, 6, 4, device, torch.bfloat16)


def randomize(*tensors: torch.Tensor, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for t in tensors:
        t.copy_(torch.randn(t.shape, generator=gen))


def test_like_copies_the_pools_per_slot_layout_and_dtypes():
    pool = make_pool()
    bank = HostSnapshotBank.like(pool, 3)
    assert bank.recurrent.shape == (2, 3, 3, 4, 5) and bank.recurrent.dtype == torch.float32
    assert bank.conv.shape == (2, 3, 3, 6) and bank.conv.dtype == torch.bfloat16
    assert not bank.recurrent.is_cuda and not bank.recurrent.is_pinned()  # a CPU pool
    assert bank.bytes_per_slot == pool.bytes_per_slot == 2 * (3 * 4 * 5 * 4 + 3 * 6 * 2)
    assert bank.usage() == BankUsage(0, 3, 0, 3 * bank.bytes_per_slot)
    bank.check_integrity()


def test_every_host_slot_from_zero_is_handed_out_and_a_double_free_is_caught():
    bank = HostSnapshotBank.like(make_pool(), 3)
    slots = [bank.allocate() for _ in range(3)]
    assert slots == [0, 1, 2] and not bank.can_allocate(1) and bank.can_allocate(0)
    assert bank.usage().n_used == 3 and bank.usage().bytes_used == 3 * bank.bytes_per_slot
    with pytest.raises(AssertionError, match="full host snapshot bank"):
        bank.allocate()
    bank.free(1)
    with pytest.raises(AssertionError):
        bank.free(1)
    with pytest.raises(AssertionError):
        bank.free(3)
    assert bank.num_free == 1 and not bank.is_allocated(1) and bank.is_allocated(2)
    bank.check_integrity()


def test_freed_host_slots_are_reused_only_after_the_other_free_slots():
    bank = HostSnapshotBank.like(make_pool(), 3)
    first = bank.allocate()
    bank.free(first)
    assert [bank.allocate() for _ in range(3)][-1] == first


def test_a_bank_of_zero_slots_is_valid_and_always_full():
    bank = HostSnapshotBank.like(make_pool(), 0)
    assert not bank.can_allocate(1) and bank.usage() == BankUsage(0, 0, 0, 0)
    assert bank.bytes_per_slot > 0
    bank.check_integrity()


def test_bank_integrity_catches_a_slot_both_free_and_allocated():
    bank = HostSnapshotBank.like(make_pool(), 3)
    slot = bank.allocate()
    bank._ids._free.append(slot)  # corrupt on purpose
    with pytest.raises(AssertionError, match="both free and allocated"):
        bank.check_integrity()


def test_store_then_load_is_a_bitwise_round_trip_of_every_layer_and_touches_nothing_else():
    pool = make_pool()
    bank = HostSnapshotBank.like(pool, 3)
    src, dst, other = pool.allocate(), pool.allocate(), pool.allocate()
    host, host_other = bank.allocate(), bank.allocate()
    randomize(pool.recurrent, pool.conv, bank.recurrent, bank.conv)
    pool_before = pool.recurrent.clone(), pool.conv.clone()
    bank_before = bank.recurrent.clone(), bank.conv.clone()
    bank.store(pool, src, host)
    for now, old, dev in zip((bank.recurrent, bank.conv), bank_before, pool_before,
                             strict=True):
        assert torch.equal(now[:, host], dev[:, src])  # every layer, bitwise
        assert torch.equal(now[:, host_other], old[:, host_other])
        assert torch.equal(now[:, 2], old[:, 2])
    for now, old in zip((pool.recurrent, pool.conv), pool_before, strict=True):
        assert torch.equal(now, old)  # a store reads the pool only
    bank.load(host, pool, dst)
    for now, old in zip((pool.recurrent, pool.conv), pool_before, strict=True):
        assert torch.equal(now[:, dst], old[:, src])
        for slot in (0, src, other, 4):
            assert torch.equal(now[:, slot], old[:, slot])


def test_store_and_load_refuse_slots_that_are_not_allocated():
    pool = make_pool()
    bank = HostSnapshotBank.like(pool, 2)
    dev, host = pool.allocate(), bank.allocate()
    with pytest.raises(AssertionError, match="device slot"):
        bank.store(pool, 3, host)
    with pytest.raises(AssertionError, match="host slot"):
        bank.store(pool, dev, 1)
    with pytest.raises(AssertionError, match="host slot"):
        bank.load(1, pool, dev)
    with pytest.raises(AssertionError, match="device slot"):
        bank.load(host, pool, 3)


def test_the_plain_constructor_matches_like():
    pool = make_pool()
    bank = HostSnapshotBank(2, 4, 3, 4, 5, 6, 4, conv_dtype=torch.bfloat16)
    like = HostSnapshotBank.like(pool, 4)
    for a, b in ((bank.recurrent, like.recurrent), (bank.conv, like.conv)):
        assert a.shape == b.shape and a.dtype == b.dtype
    host = bank.allocate()
    bank.store(pool, pool.allocate(), host)  # layouts agree: snapshot_copy accepts them


@pytest.mark.gpu
def test_a_cuda_pool_gets_a_pinned_bank_and_copies_round_trip_through_it():
    pool = make_pool(num_slots=3, device="cuda")  # so the freed slot is the next handed out
    bank = HostSnapshotBank.like(pool, 2)
    assert bank.recurrent.is_pinned() and bank.conv.is_pinned()
    src, dst = pool.allocate(), pool.allocate()
    pool.recurrent.normal_()
    pool.conv.normal_()
    host = bank.allocate()
    bank.store(pool, src, host)
    pool.free(src)
    again = pool.allocate()  # the freed slot, rewritten by later work on the current stream
    assert again == src
    pool.zero(again)
    bank.load(host, pool, dst)
    bank.synchronize()
    torch.cuda.synchronize()
    assert torch.equal(bank.recurrent[:, host], pool.recurrent[:, dst].cpu())
    assert torch.equal(bank.conv[:, host], pool.conv[:, dst].cpu())
    assert bank.recurrent[:, host].any()  # the store read the state before the zero
    bank.check_integrity()
