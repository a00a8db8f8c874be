"""snapshot_copy on CUDA: bitwise copies device<->device and device<->pinned host, and an
asynchronous device->host copy (the host call returns before the copy has run)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import snapshot_copy
from deltaserve.ops._ext import extension_loaded

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


def _pools(slots, device, seed, pin=False):
    gen = torch.Generator().manual_seed(seed)
    rec = torch.randn(5, slots, 4, 64, 64, generator=gen)
    conv = torch.randn(5, slots, 3, 512, generator=gen).bfloat16()
    if pin:
        return rec.pin_memory(), conv.pin_memory()
    return rec.to(device), conv.to(device)


@pytest.mark.parametrize("route", ["d2d", "d2h", "h2d"])
def test_copies_all_layers_of_each_slot_bitwise(route):
    src = _pools(9, "cuda", 0, pin=route == "h2d")
    dst = _pools(7, "cuda", 1, pin=route == "d2h")
    before = tuple(t.clone() for t in dst)
    src_slots, dst_slots = [8, 2, 5, 5], [1, 6, 3, 0]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    snapshot_copy(src, src_slots, dst, torch.tensor(dst_slots), stream=stream)
    stream.synchronize()
    for a, b, old in zip(src, dst, before, strict=True):
        for s, d in zip(src_slots, dst_slots, strict=True):
            assert torch.equal(b[:, d].cpu(), a[:, s].cpu())
        assert torch.equal(b[:, [2, 4, 5]].cpu(), old[:, [2, 4, 5]].cpu())


def test_device_to_host_copy_returns_before_the_copy_completes():
    src = _pools(4, "cuda", 2)
    dst = _pools(4, "cpu", 3, pin=True)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(500_000_000)  # ~0.25 s of GPU time queued ahead of the copy
    snapshot_copy(src, [1, 3], dst, [0, 2], stream=stream)
    done = torch.cuda.Event()
    done.record(stream)
    assert not done.query(), "snapshot_copy waited for the device"
    done.synchronize()
    for a, b in zip(src, dst, strict=True):
        assert torch.equal(b[:, 0], a[:, 1].cpu()) and torch.equal(b[:, 2], a[:, 3].cpu())


def _pool(layers, slots, slot_shape, dtype, seed, shift=0):
    """A [layers, slots, *slot_shape] CUDA pool; `shift` elements past an allocation's start, so
    shift=1 gives a base pointer that is not 16-byte aligned."""
    gen = torch.Generator().manual_seed(seed)
    numel = layers * slots * torch.Size(slot_shape).numel()
    flat = torch.randn(numel + shift, generator=gen).to(dtype).cuda()
    return flat[shift:].view(layers, slots, *slot_shape)


# Per-slot bytes and base alignment pick the kernel's copy unit: 16-byte vectors over several
# tiles of a row (64 KiB), a partial last tile (16400 B), the 4-byte path (60 B), the byte path
# (30 B) and the 4-byte path forced by a base pointer 4 bytes past a 16-byte boundary.
@pytest.mark.parametrize(("slot_shape", "dtype", "shift"), [
    ((4, 64, 64), torch.float32, 0),
    ((4100,), torch.float32, 0),
    ((3, 5), torch.float32, 0),
    ((3, 5), torch.bfloat16, 0),
    ((4, 8), torch.float32, 1),
])
def test_device_copy_of_more_than_64_pairs_between_pools_of_other_sizes_matches_indexing(
        slot_shape, dtype, shift):
    src = _pool(3, 130, slot_shape, dtype, seed=4, shift=shift)
    dst = _pool(3, 110, slot_shape, dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    src_slots = torch.randint(0, 130, (100,), generator=gen).tolist()  # repeats: read twice
    dst_slots = torch.randperm(110, generator=gen)[:100].tolist()
    expected = dst.clone()
    expected[:, dst_slots] = src[:, src_slots]
    torch.ops.deltaserve.snapshot_copy(src, dst, src_slots, dst_slots)
    torch.cuda.synchronize()
    assert torch.equal(dst, expected)


def test_device_copy_within_one_pool_moves_disjoint_slots():
    pool = _pool(4, 200, (3, 40), torch.bfloat16, seed=7)
    src_slots, dst_slots = list(range(70)), list(range(199, 129, -1))
    expected = pool.clone()
    expected[:, dst_slots] = pool[:, src_slots]
    torch.ops.deltaserve.snapshot_copy(pool, pool, src_slots, dst_slots)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)


# All pairs of a call run at once, so these would race; each is refused before anything runs.
@pytest.mark.parametrize(("same_pool", "src_slots", "dst_slots", "message"), [
    (True, [3, 5], [4, 5], "both reads and writes a slot"),  # a slot onto itself
    (True, [3, 4], [4, 6], "both reads and writes a slot"),  # 3 -> 4 while 4 -> 6
    (False, [1, 2], [6, 6], "writes a destination slot twice"),
])
def test_device_copy_that_would_race_raises_and_copies_nothing(same_pool, src_slots, dst_slots,
                                                                message):
    pool = _pool(2, 8, (16,), torch.float32, seed=8)
    dst = pool if same_pool else _pool(2, 8, (16,), torch.float32, seed=9)
    before = dst.clone()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.deltaserve.snapshot_copy(pool, dst, src_slots, dst_slots)
    torch.cuda.synchronize()
    assert torch.equal(dst, before)
