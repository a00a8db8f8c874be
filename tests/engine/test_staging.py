"""Step inputs staged for a non-blocking copy: positions built without a per-token loop, and
static buffers refilled with exactly the given values."""

from __future__ import annotations

import pytest
import torch

from deltaserve.engine.staging import PinnedRing, copy_into, row_positions, staged, to_device


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


class _Event:
    """Stands in for torch.cuda.Event: records when it was recorded and waited on."""

    def __init__(self, log: list) -> None:
        self.log = log

    def record(self) -> None:
        self.log.append(("record", self))

    def synchronize(self) -> None:
        self.log.append(("wait", self))


def test_the_pinned_ring_never_hands_out_a_region_before_its_last_copy_was_waited_for():
    log: list = []
    ring = PinnedRing(capacity=4096, pin=False, new_event=lambda: _Event(log))
    gen = torch.Generator().manual_seed(2)
    live: list[tuple[int, int, int, torch.Tensor, torch.Tensor]] = []  # (lap, start, end, ...)
    waited_laps = set()
    lap = 0
    for _ in range(200):
        n = int(torch.randint(1, 200, (1,), generator=gen))
        values = torch.randint(-2**40, 2**40, (n,), generator=gen).numpy()
        before = len(log)
        t = ring.stage(values)
        if len(log) > before:  # switched halves: recorded the old half, waited on the new one
            lap += 1
            kinds = [k for k, _ in log[before:]]
            assert kinds[0] == "record" and kinds[1:] in ([], ["wait"])
            if kinds[1:]:
                waited_laps.add(lap)
        start = t.data_ptr() - ring.buf.data_ptr()
        assert start % PinnedRing.ALIGN == 0 and start + t.nbytes <= ring.buf.numel()
        assert (start >= ring.half) == (lap % 2 == 1)  # a region never straddles the halves
        assert torch.equal(t, torch.from_numpy(values))
        # a region overlapping one handed out earlier is only reused two laps later, after the
        # wait on the event recorded when that earlier lap's half was left
        for old_lap, s0, e0, _t, _v in live:
            if s0 < start + t.nbytes and start < e0:
                assert lap >= old_lap + 2 and lap in waited_laps
        live = [x for x in live if x[0] >= lap - 1]
        for _lap, s0, e0, old_t, old_v in live:  # everything of the last two laps intact
            if not (s0 < start + t.nbytes and start < e0):
                assert torch.equal(old_t, old_v)
        live.append((lap, start, start + t.nbytes, t, torch.from_numpy(values.copy())))
    assert lap >= 4
    assert ring.stage(torch.zeros(ring.half // 8 + 1, dtype=torch.int64).numpy()) is None


def test_staged_values_keep_dtype_and_shape():
    t = staged([[1, 2], [3, 4]], torch.int32, torch.device("cpu"))
    assert t.dtype == torch.int32 and t.tolist() == [[1, 2], [3, 4]]


@pytest.mark.gpu
def test_staged_copies_queued_behind_a_busy_gpu_keep_their_values_across_laps():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    n = 1 << 15  # 256 KB a copy: 8 a half, so 40 copies go round the ring 2.5 times
    outs = [torch.empty(n, dtype=torch.int64, device="cuda") for _ in range(40)]
    torch.cuda._sleep(200_000_000)  # the copies queue behind this; the host runs ahead
    for i, out in enumerate(outs):
        copy_into(out, torch.arange(i, i + n).numpy())
    for i, out in enumerate(outs):
        assert torch.equal(out.cpu(), torch.arange(i, i + n)), i
