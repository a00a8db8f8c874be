"""The pure-torch causal conv1d reference: prefill/update/verify/commit agree with each other
and with torch's Conv1d; tracked windows are the windows at the given offsets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.ops import (
    causal_conv1d_commit,
    causal_conv1d_prefill,
    causal_conv1d_update,
    causal_conv1d_verify,
)

W, D = 4, 24


def _setup(seed, slots=6, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(D, W, generator=gen).to(dtype)
    bias = torch.randn(D, generator=gen).to(dtype)
    state = torch.randn(slots, W - 1, D, generator=gen).to(dtype)
    return gen, weight, bias, state


def _cu(lengths):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def test_prefill_equals_torch_conv1d_continued_from_the_window():
    gen, weight, bias, state = _setup(0)
    lengths, slots = [5, 1, 9], torch.tensor([3, 1, 4], dtype=torch.int32)
    x = torch.randn(sum(lengths), D, generator=gen)
    before = state.clone()
    y = causal_conv1d_prefill(x, weight, bias, state, _cu(lengths), slots)
    cu = _cu(lengths).tolist()
    for i, slot in enumerate(slots.tolist()):
        z = torch.cat([before[slot], x[cu[i]:cu[i + 1]]])  # [W-1+L, D]
        expect = F.silu(F.conv1d(z.t()[None], weight[:, None], bias, groups=D))[0].t()
        torch.testing.assert_close(y[cu[i]:cu[i + 1]], expect, atol=1e-5, rtol=1e-5)
        assert torch.equal(state[slot], z[-(W - 1):])
    assert torch.equal(state[[0, 2, 5]], before[[0, 2, 5]])


def test_prefill_equals_stepwise_updates_and_tracks_windows_at_offsets():
    gen, weight, bias, state = _setup(1)
    lengths, slots = [7, 2], torch.tensor([1, 2], dtype=torch.int32)
    x = torch.randn(sum(lengths), D, generator=gen).bfloat16()
    weight, bias, state = weight.bfloat16(), bias.bfloat16(), state.bfloat16()
    stepped = state.clone()
    y = causal_conv1d_prefill(x, weight, bias, state, _cu(lengths), slots,
                              track_offsets=torch.tensor([3, 0], dtype=torch.int32),
                              track_slots=torch.tensor([5, 0], dtype=torch.int32))
    rows = [causal_conv1d_update(x[t:t + 1], weight, bias, stepped, slots[:1]) for t in range(3)]
    assert torch.equal(state[5], stepped[1]), "window after 3 tokens of sequence 0"
    rows += [causal_conv1d_update(x[t:t + 1], weight, bias, stepped, slots[:1])
             for t in range(3, 7)]
    rows += [causal_conv1d_update(x[t:t + 1], weight, bias, stepped, slots[1:])
             for t in range(7, 9)]
    assert torch.equal(y, torch.cat(rows))
    assert torch.equal(state[1:3], stepped[1:3])
    assert torch.equal(state[0], stepped[0]), "track slot 0 means no tracking"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_rows_equal_update_outputs_and_leave_windows_untouched(dtype):
    gen, weight, bias, state = _setup(2, dtype=dtype)
    n, r = 3, 4
    x = torch.randn(n, r, D, generator=gen).to(dtype)
    slots = torch.tensor([4, 0, 2], dtype=torch.int32)
    before = state.clone()
    y = causal_conv1d_verify(x, weight, bias, state, slots)
    assert torch.equal(state, before)
    for i in range(r):
        assert torch.equal(y[[0, 2], i],
                           causal_conv1d_update(x[[0, 2], i], weight, bias, state, slots[[0, 2]]))


def test_commit_equals_accepted_many_updates():
    gen, weight, bias, state = _setup(3)
    n, r = 4, 3
    x = torch.randn(n, r, D, generator=gen)
    slots = torch.tensor([5, 1, 3, 2], dtype=torch.int32)
    accepted = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    stepped = state.clone()
    causal_conv1d_commit(x, state, slots, accepted)
    for i, slot in enumerate(slots.tolist()):
        for j in range(int(accepted[i])):
            causal_conv1d_update(x[i:i + 1, j], weight, bias, stepped,
                                 torch.tensor([slot], dtype=torch.int32))
    assert torch.equal(state, stepped)


def test_mismatched_shapes_raise():
    _, weight, bias, state = _setup(4)
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(torch.zeros(2, D), weight, bias, state[:, :2],
                             torch.tensor([1, 2], dtype=torch.int32))
