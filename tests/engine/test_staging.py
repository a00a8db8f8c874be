"""Step inputs staged for a non-blocking copy: positions built without a per-token loop, and
static buffers refilled with exactly the given values."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.staging import copy_into, row_positions, to_device


def test_row_positions_are_each_requests_consecutive_positions():
    assert row_positions([5, 0, 9], [2, 3, 1]).tolist() == [5, 6, 0, 1, 2, 9]
    assert row_positions([7, 2], 3).tolist() == [7, 8, 9, 2, 3, 4]
    assert row_positions([], 4).tolist() == []


def test_row_positions_equal_the_per_token_loop_on_random_batches():
    gen = torch.Generator().manual_seed(4)
    for _ in range(20):
        n = int(torch.randint(1, 9, (1,), generator=gen))
        starts = torch.randint(0, 5000, (n,), generator=gen).tolist()
        rows = torch.randint(0, 70, (n,), generator=gen).tolist()
        loop = [p for s, r in zip(starts, rows) for p in range(s, s + r)]
        assert row_positions(starts, rows).tolist() == loop


def test_to_device_and_copy_into_keep_values_and_dtype():
    t = to_device([3, -1, 2**40], torch.int64, torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [3, -1, 2**40]
    buf = torch.full((5,), 9, dtype=torch.int32)
    copy_into(buf, [1, 2, 3])
    assert buf.tolist() == [1, 2, 3, 9, 9]


@pytest.mark.gpu
def test_a_staged_copy_reaches_the_device_in_stream_order():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    buf = torch.zeros(1 << 16, dtype=torch.int64, device="cuda")
    for step in range(50):  # each step's values must land, never a stale or reused block's
        values = torch.arange(step, step + buf.shape[0])
        copy_into(buf, values.numpy())
        assert torch.equal(buf.cpu(), values)
    assert to_device([1, 2], torch.int32, torch.device("cuda")).cpu().tolist() == [1, 2]
