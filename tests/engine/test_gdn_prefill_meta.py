"""GDNPrefill: a prefill forward's GDN indices from host lists, a tracked request split into two
chained sequences whose first final state goes to the track slot."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deltaserve.engine.gdn_backend import GDNPrefill


def upload_recorder():
    uploads = []

    def upload(arr: np.ndarray) -> torch.Tensor:
        uploads.append(arr.dtype)
        return torch.from_numpy(arr.copy())

    return upload, uploads


def test_a_tracked_request_becomes_two_chained_sequences():
    upload, uploads = upload_recorder()
    pre = GDNPrefill.build([100, 256, 30], [5, 9, 7], [None, (192, 11), None], upload)
    assert pre.cu_seqlens.tolist() == [0, 100, 356, 386]
    assert pre.slots.tolist() == [5, 9, 7]
    assert pre.track_offsets.tolist() == [0, 192, 0]
    assert pre.track_slots.tolist() == [0, 11, 0]
    assert pre.index.bounds == (0, 100, 292, 356, 386)
    assert pre.index.chained == (False, False, True, False)
    assert pre.src.tolist() == [5, 9, 9, 7]  # the chained sequence's row is not read
    assert pre.dest.tolist() == [5, 11, 9, 7]  # the state at depth 192 -> the track slot
    assert pre.cu_seqlens.dtype == pre.slots.dtype == torch.int32
    assert pre.src.dtype == pre.index.cu_seqlens.dtype == torch.int64
    assert len(uploads) == 3


def test_without_tracks_there_are_no_conv_tracks_and_no_chains():
    upload, _ = upload_recorder()
    pre = GDNPrefill.build([3, 4], [1, 2], None, upload)
    assert pre.track_offsets is None and pre.track_slots is None
    assert pre.index.bounds == (0, 3, 7) and not any(pre.index.chained)
    assert pre.src.tolist() == pre.dest.tolist() == [1, 2]


@pytest.mark.parametrize("offset", [0, 10, 11])
def test_a_track_offset_outside_the_chunk_is_refused(offset):
    upload, _ = upload_recorder()
    with pytest.raises(ValueError, match="inside its chunk"):
        GDNPrefill.build([10], [1], [(offset, 3)], upload)
