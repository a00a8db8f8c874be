"""The op wrappers refuse bad arguments with a ValueError naming them, before anything is
written (a fresh user's findings: a prefill whose cu_seqlens left rows of x uncovered returned
uninitialised memory; negative slots wrapped to the pool's last slot; mismatched shapes
broadcast or failed deep inside torch)."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import gdn_inputs, random_state

from deltaserve import ops
from deltaserve.ops.gdn import GDNStash

I32 = dict(dtype=torch.int32)


def conv_args(n=2, d=8, slots_total=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(d, 4, generator=g), torch.randn(d, generator=g),
            torch.randn(slots_total, 3, d, generator=g))


def test_conv_prefill_refuses_seqlens_that_leave_rows_unwritten_and_writes_nothing():
    weight, bias, state = conv_args()
    before = state.clone()
    x = torch.randn(5, 8)
    slots = torch.tensor([1], **I32)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to the 5"):
        ops.causal_conv1d_prefill(x, weight, bias, state, torch.tensor([0, 2], **I32), slots)
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the 5"):
        ops.causal_conv1d_prefill(x, weight, bias, state, torch.tensor([0, 7], **I32), slots)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[2\]"):
        ops.causal_conv1d_prefill(x, weight, bias, state, torch.tensor([0, 2, 5], **I32), slots)
    assert torch.equal(state, before)


@pytest.mark.parametrize(("change", "message"), [
    (dict(bias=torch.randn(3)), r"bias must have shape \[8\]"),
    (dict(x=torch.randn(1, 5, 8)), "x must have 2 dims"),
    (dict(x=torch.ones(5, 8, dtype=torch.int64)), "x must be a floating-point"),
    (dict(slots=torch.tensor([-1], **I32)), r"slots must lie in \[0, 4\)"),
    (dict(slots=torch.tensor([4], **I32)), r"slots must lie in \[0, 4\)"),
    (dict(slots=torch.tensor([1.0])), "slots must be int32"),
    (dict(track_offsets=torch.tensor([6], **I32), track_slots=torch.tensor([2], **I32)),
     "track_offsets must lie in 0..length"),
    (dict(track_offsets=torch.tensor([1], **I32), track_slots=torch.tensor([9], **I32)),
     r"track_slots must lie in \[0, 4\)"),
])
def test_conv_prefill_names_the_bad_argument(change, message):
    weight, bias, state = conv_args()
    before = state.clone()
    args = dict(x=torch.randn(5, 8), weight=weight, bias=bias, conv_state=state,
                cu_seqlens=torch.tensor([0, 5], **I32), slots=torch.tensor([1], **I32))
    args.update(change)
    with pytest.raises(ValueError, match=message):
        ops.causal_conv1d_prefill(**args)
    assert torch.equal(state, before)


def test_conv_update_verify_commit_refuse_mismatched_slots_and_accepted():
    weight, bias, state = conv_args()
    before = state.clone()
    with pytest.raises(ValueError, match=r"slots must have shape \[2\]"):
        ops.causal_conv1d_update(torch.randn(2, 8), weight, bias, state,
                                 torch.tensor([1], **I32))
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 4\)"):
        ops.causal_conv1d_update(torch.randn(2, 8), weight, bias, state,
                                 torch.tensor([1, -1], **I32))
    with pytest.raises(ValueError, match="x must have 3 dims"):
        ops.causal_conv1d_verify(torch.randn(2, 8), weight, bias, state,
                                 torch.tensor([1, 2], **I32))
    with pytest.raises(ValueError, match=r"accepted must have shape \[2\]"):
        ops.causal_conv1d_commit(torch.randn(2, 3, 8), state, torch.tensor([1, 2], **I32),
                                 torch.tensor([1], **I32))
    assert torch.equal(state, before)


def test_gdn_decode_and_verify_name_mismatched_heads_and_shapes():
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(2, None, 2, 4, 32, 32, seed=1)
    pool = random_state(3, 4, 32, 32, seed=2)
    before = pool.clone()
    slots = torch.tensor([1, 2], **I32)
    with pytest.raises(ValueError, match=r"k must have shape \[2, 2, 32\]"):
        ops.gdn_decode(q, k[:, :1], v, a, b, A_log, dt_bias, pool, slots, 0.1)
    with pytest.raises(ValueError, match=r"a must have shape \[2, 4\]"):
        ops.gdn_decode(q, k, v, a[:, :2], b, A_log, dt_bias, pool, slots, 0.1)
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 3\)"):
        ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([1, 3], **I32), 0.1)
    with pytest.raises(ValueError, match="slots must be int32"):  # dtype before values
        ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, torch.tensor([1.0, 9.0]), 0.1)
    q3, k3 = torch.randn(2, 3, 32), torch.randn(2, 3, 32)
    with pytest.raises(ValueError, match="HV=4 must be a multiple of H=3"):
        ops.gdn_decode(q3, k3, v, a, b, A_log, dt_bias, pool, slots, 0.1)
    stash = GDNStash.allocate(1, 2, 4, 2, 4, 32, 32, "cpu")
    # decode-shaped inputs to verify: named as such, not as a stash too small
    with pytest.raises(ValueError, match=r"v must be \[N, R, HV, V\]"):
        ops.gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, 0.1, stash, 0)
    assert torch.equal(pool, before)


def test_gdn_replay_and_prefill_refuse_mismatched_counts():
    stash = GDNStash.allocate(1, 2, 4, 2, 4, 32, 32, "cpu")
    pool = random_state(3, 4, 32, 32, seed=3, layers=1)
    before = pool.clone()
    with pytest.raises(ValueError, match=r"accepted must have shape \[2\]"):
        ops.gdn_replay(stash, pool, torch.tensor([1, 2], **I32), torch.tensor([1], **I32))
    with pytest.raises(ValueError, match=r"slots must lie in \[0, 3\)"):
        ops.gdn_replay(stash, pool, torch.tensor([1, -2], **I32), torch.tensor([1, 1], **I32))
    assert torch.equal(pool, before)
    q, k, v = torch.randn(6, 2, 32), torch.randn(6, 2, 32), torch.randn(6, 4, 32)
    g, beta = -torch.rand(6, 4), torch.rand(6, 4)
    init = torch.zeros(2, 4, 32, 32)
    with pytest.raises(ValueError, match=r"cu_seqlens must have shape \[3\]"):
        ops.gdn_prefill(q, k, v, g, beta, init, torch.tensor([0, 6], **I32), 0.1)
    with pytest.raises(ValueError, match="cu_seqlens must rise from 0 to the 6"):
        ops.gdn_prefill(q, k, v, g, beta, init, torch.tensor([0, 4, 9], **I32), 0.1)


def test_snapshot_copy_refuses_slots_outside_the_pools():
    src = (torch.zeros(2, 4, 3), torch.zeros(2, 4, 5))
    dst = (torch.ones(2, 6, 3), torch.ones(2, 6, 5))
    with pytest.raises(ValueError, match=r"source slots must lie in \[0, 4\)"):
        ops.snapshot_copy(src, [-1], dst, [1])
    with pytest.raises(ValueError, match=r"destination slots must lie in \[0, 6\)"):
        ops.snapshot_copy(src, [1], dst, [6])
    assert all(bool((t == 1).all()) for t in dst)
