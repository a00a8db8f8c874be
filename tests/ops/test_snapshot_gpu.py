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
