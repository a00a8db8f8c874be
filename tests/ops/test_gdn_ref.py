"""The pure-torch GDN reference: decode against a float64 recurrence, prefill against decode and
transformers, verify/replay bitwise against decode."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import gdn_inputs, random_state
from transformers.models.qwen3_next import modeling_qwen3_next

from deltaserve.ops import GDNStash, gdn_decode, gdn_gates, gdn_prefill, gdn_replay, gdn_verify

# transformers wraps its torch function to dispatch to fla-core when installed; take the original.
_hf_chunk = modeling_qwen3_next.torch_chunk_gated_delta_rule
torch_chunk_gated_delta_rule = getattr(_hf_chunk, "__wrapped__", _hf_chunk)


def naive_decode_f64(q, k, v, a, b, A_log, dt_bias, state, slots, scale):
    """Per request, per value head, one row of eq. 10 in float64 (state updated in place)."""
    n, h, _ = q.shape
    hv = v.shape[1]
    out = torch.empty(v.shape, dtype=torch.float64)
    for i in range(n):
        for j in range(hv):
            kh = j // (hv // h)
            qv, kv = q[i, kh].double(), k[i, kh].double()
            qv = qv / torch.sqrt((qv * qv).sum() + 1e-6) * scale
            kv = kv / torch.sqrt((kv * kv).sum() + 1e-6)
            g = -torch.exp(A_log[j].double()) * torch.nn.functional.softplus(
                a[i, j].double() + dt_bias[j].double())
            beta = torch.sigmoid(b[i, j].double())
            s = state[slots[i], j].double() * torch.exp(g)
            s = s + beta * torch.outer(v[i, j].double() - s @ kv, kv)
            state[slots[i], j] = s.to(state.dtype)
            out[i, j] = s @ qv
    return out


@pytest.mark.parametrize("h,hv", [(2, 2), (2, 4), (1, 4)])
def test_decode_matches_a_float64_recurrence_over_several_steps(h, hv):
    kd, vd, n = 16, 8, 3
    state = random_state(6, hv, vd, kd, seed=1)
    ref = state.clone()
    slots = torch.tensor([4, 1, 5], dtype=torch.int32)
    for step in range(4):
        q, k, v, a, b, A_log, dt_bias = gdn_inputs(n, None, h, hv, kd, vd, seed=10 + step)
        o = gdn_decode(q, k, v, a, b, A_log, dt_bias, state, slots, kd ** -0.5)
        o_ref = naive_decode_f64(q, k, v, a, b, A_log, dt_bias, ref, slots.long(), kd ** -0.5)
        torch.testing.assert_close(o.double(), o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(state, ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(state[[0, 2, 3]], random_state(6, hv, vd, kd, seed=1)[[0, 2, 3]])


def test_decode_outputs_do_not_depend_on_batch_composition():
    h, hv, kd, vd = 2, 4, 32, 16
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(5, None, h, hv, kd, vd, seed=3)
    full = random_state(8, hv, vd, kd, seed=4)
    alone = full.clone()
    slots = torch.tensor([7, 2, 0, 0, 5], dtype=torch.int32)
    o_all = gdn_decode(q, k, v, a, b, A_log, dt_bias, full, slots, kd ** -0.5)
    o_one = gdn_decode(q[1:2], k[1:2], v[1:2], a[1:2], b[1:2], A_log, dt_bias, alone,
                       slots[1:2], kd ** -0.5)
    assert torch.equal(o_all[1], o_one[0])
    assert torch.equal(full[2], alone[2])


def test_gates_follow_the_qwen3_next_formula():
    a, b = torch.randn(3, 4), torch.randn(3, 4)
    A_log, dt_bias = torch.randn(4), torch.randn(4)
    g, beta = gdn_gates(a.bfloat16(), b.bfloat16(), A_log, dt_bias)
    assert g.dtype == beta.dtype == torch.float32
    expect = -A_log.exp() * torch.log1p(torch.exp(a.bfloat16().float() + dt_bias))
    torch.testing.assert_close(g, expect)
    torch.testing.assert_close(beta, torch.sigmoid(b.bfloat16().float()))


def _prefill_inputs(lengths, h, hv, kd, vd, seed):
    t = sum(lengths)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(t, None, h, hv, kd, vd, seed=seed)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, a, b, A_log, dt_bias, g, beta, cu


@pytest.mark.parametrize("lengths,h,hv", [([1, 70, 130], 2, 4), ([64, 0, 5], 2, 2)])
def test_prefill_matches_stepwise_decode_with_initial_and_final_states(lengths, h, hv):
    kd, vd = 16, 8
    q, k, v, a, b, A_log, dt_bias, g, beta, cu = _prefill_inputs(lengths, h, hv, kd, vd, 5)
    init = random_state(len(lengths), hv, vd, kd, seed=6)
    o, final = gdn_prefill(q, k, v, g, beta, init, cu, kd ** -0.5)
    assert o.shape == v.shape and final.shape == init.shape and final.dtype == torch.float32
    state = init.clone()
    seq_of_row = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    for t in range(q.shape[0]):
        slot = seq_of_row[t:t + 1].int()
        o_t = gdn_decode(q[t:t + 1], k[t:t + 1], v[t:t + 1], a[t:t + 1], b[t:t + 1], A_log,
                         dt_bias, state, slot, kd ** -0.5)
        torch.testing.assert_close(o[t], o_t[0], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(final, state, atol=1e-4, rtol=1e-4)


def test_prefill_matches_transformers_chunked_reference():
    h, hv, kd, vd, t = 2, 4, 32, 16, 150
    q, k, v, a, b, A_log, dt_bias, g, beta, cu = _prefill_inputs([t], h, hv, kd, vd, 7)
    init = random_state(1, hv, vd, kd, seed=8)
    o, final = gdn_prefill(q, k, v, g, beta, init, cu, kd ** -0.5)
    o_hf, final_hf = torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g[None], beta[None], chunk_size=64,
        initial_state=init.transpose(-1, -2), output_final_state=True,
        use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_hf[0], atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, final_hf.transpose(-1, -2), atol=2e-5, rtol=1e-5)


def _verify_case(n, r, h, hv, kd, vd, layers, seed):
    ins = [gdn_inputs(n, r, h, hv, kd, vd, seed=seed + i) for i in range(layers)]
    pool = random_state(7, hv, vd, kd, seed=seed + 100, layers=layers)
    return ins, pool


def test_verify_rows_equal_decode_outputs_bitwise_and_leave_the_state_untouched():
    n, r, h, hv, kd, vd = 3, 4, 2, 4, 32, 16
    (ins,), pool = _verify_case(n, r, h, hv, kd, vd, 1, seed=20)
    q, k, v, a, b, A_log, dt_bias = ins
    slots = torch.tensor([6, 2, 3], dtype=torch.int32)
    stash = GDNStash.allocate(1, 4, 5, h, hv, kd, vd, "cpu")
    before = pool.clone()
    o = gdn_verify(q, k, v, a, b, A_log, dt_bias, pool[0], slots, kd ** -0.5, stash, 0)
    assert torch.equal(pool, before)
    state = pool[0].clone()
    for i in range(r):
        o_d = gdn_decode(q[:, i], k[:, i], v[:, i], a[:, i], b[:, i], A_log, dt_bias, state,
                         slots, kd ** -0.5)
        assert torch.equal(o[:, i], o_d), f"row {i}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_replay_of_n_rows_equals_n_decode_steps_bitwise_in_every_layer(dtype):
    n, r, h, hv, kd, vd, layers = 4, 5, 1, 2, 16, 16, 3
    ins, pool = _verify_case(n, r, h, hv, kd, vd, layers, seed=40)
    ins = [tuple(x.to(dtype) if x.dim() > 1 else x for x in layer) for layer in ins]
    slots = torch.tensor([5, 1, 0, 3], dtype=torch.int32)
    accepted = torch.tensor([2, 5, 0, 1], dtype=torch.int32)
    stash = GDNStash.allocate(layers, 6, r, h, hv, kd, vd, "cpu")
    live = pool.clone()
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        gdn_verify(q, k, v, a, b, A_log, dt_bias, live[layer], slots, kd ** -0.5, stash, layer)
    gdn_replay(stash, live, slots, accepted)
    expect = pool.clone()
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        for i, acc in enumerate(accepted.tolist()):
            for row in range(acc):
                sl = slice(i, i + 1)
                gdn_decode(q[sl, row], k[sl, row], v[sl, row], a[sl, row], b[sl, row], A_log,
                           dt_bias, expect[layer], slots[sl], kd ** -0.5)
    assert torch.equal(live, expect)


def test_replay_with_nothing_accepted_changes_nothing():
    n, r, h, hv, kd, vd = 2, 3, 2, 2, 8, 8
    (ins,), pool = _verify_case(n, r, h, hv, kd, vd, 1, seed=60)
    stash = GDNStash.allocate(1, n, r, h, hv, kd, vd, "cpu")
    slots = torch.tensor([1, 2], dtype=torch.int32)
    gdn_verify(*ins, pool[0], slots, kd ** -0.5, stash, 0)
    before = pool.clone()
    gdn_replay(stash, pool, slots, torch.zeros(n, dtype=torch.int32))
    assert torch.equal(pool, before)


def test_bad_shapes_raise_clear_errors():
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(2, None, 2, 4, 8, 8, seed=0)
    with pytest.raises(ValueError, match="fp32"):
        gdn_decode(q, k, v, a, b, A_log, dt_bias, torch.zeros(3, 4, 8, 8).half(),
                   torch.tensor([1, 2], dtype=torch.int32), 8 ** -0.5)
    stash = GDNStash.allocate(1, 1, 2, 2, 4, 8, 8, "cpu")
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(2, 2, 2, 4, 8, 8, seed=0)
    with pytest.raises(ValueError, match="stash holds"):
        gdn_verify(q, k, v, a, b, A_log, dt_bias, torch.zeros(3, 4, 8, 8),
                   torch.tensor([1, 2], dtype=torch.int32), 8 ** -0.5, stash, 0)
    # no rows: the CUDA one-tile and multi-tile launches would disagree on pending rows
    with pytest.raises(ValueError, match="R >= 1"):
        gdn_verify(*(x[:, :0] for x in (q, k, v, a, b)), A_log, dt_bias,
                   torch.zeros(3, 4, 8, 8), torch.tensor([1, 2], dtype=torch.int32),
                   8 ** -0.5, GDNStash.allocate(1, 2, 2, 2, 4, 8, 8, "cpu"), 0)


def test_verify_with_pending_rows_is_replay_of_that_layer_then_verify():
    n, r, h, hv, kd, vd, layers = 4, 3, 2, 4, 16, 16, 2
    first, pool = _verify_case(n, r, h, hv, kd, vd, layers, seed=80)
    second, _ = _verify_case(n, r, h, hv, kd, vd, layers, seed=81)
    slots = torch.tensor([3, 1, 5, 2], dtype=torch.int32)
    accepted = torch.tensor([0, 3, 1, 2], dtype=torch.int32)
    prev = GDNStash.allocate(layers, n, r, h, hv, kd, vd, "cpu")
    for layer, x in enumerate(first):
        gdn_verify(*x, pool[layer], slots, kd ** -0.5, prev, layer)
    fused, split = pool.clone(), pool.clone()
    gdn_replay(prev, split, slots, accepted)
    st_f = GDNStash.allocate(layers, n, r, h, hv, kd, vd, "cpu")
    st_s = GDNStash.allocate(layers, n, r, h, hv, kd, vd, "cpu")
    for layer, x in enumerate(second):
        o_f = gdn_verify(*x, fused[layer], slots, kd ** -0.5, st_f, layer,
                         pending=(prev, accepted))
        o_s = gdn_verify(*x, split[layer], slots, kd ** -0.5, st_s, layer)
        assert torch.equal(o_f, o_s)
    assert torch.equal(fused, split)
    assert not torch.equal(fused, pool), "the accepted rows were applied"
    x = second[0]
    with pytest.raises(ValueError, match="second buffer"):
        gdn_verify(*x, fused[0], slots, kd ** -0.5, st_f, 0, pending=(st_f, accepted))
    with pytest.raises(ValueError, match="pending rows must be"):
        gdn_verify(*x, fused[0], slots, kd ** -0.5, st_f, 0, pending=(prev, accepted[:2]))
    small = GDNStash.allocate(layers, n, r - 1, h, hv, kd, vd, "cpu")
    with pytest.raises(ValueError, match="second buffer"):
        gdn_verify(*x, fused[0], slots, kd ** -0.5, st_f, 0, pending=(small, accepted))


def test_verify_and_replay_stay_bitwise_for_a_large_mixed_batch():
    """Big enough for ATen to vectorise and split work across threads differently per shape."""
    n, r, h, hv, kd, vd = 37, 3, 2, 8, 32, 32
    (ins,), pool = _verify_case(n, r, h, hv, kd, vd, 1, seed=70)
    q, k, v, a, b, A_log, dt_bias = ins
    pool = random_state(n + 1, hv, vd, kd, seed=71, layers=1)
    slots = torch.randperm(n, generator=torch.Generator().manual_seed(72)).int() + 1
    accepted = torch.randint(0, r + 1, (n,), generator=torch.Generator().manual_seed(73)).int()
    stash = GDNStash.allocate(1, n, r, h, hv, kd, vd, "cpu")
    live = pool.clone()
    o = gdn_verify(q, k, v, a, b, A_log, dt_bias, live[0], slots, kd ** -0.5, stash, 0)
    gdn_replay(stash, live, slots, accepted)
    expect = pool.clone()
    for row in range(r):
        o_d = gdn_decode(q[:, row], k[:, row], v[:, row], a[:, row], b[:, row], A_log, dt_bias,
                         expect[0], slots, kd ** -0.5)
        assert torch.equal(o[:, row], o_d)
        if row == 0:
            state_after = {i: expect[0, slots[i]].clone() for i in range(n)}
        for i in range(n):
            if int(accepted[i]) == row + 1:
                state_after[i] = expect[0, slots[i]].clone()
    for i in range(n):
        want = pool[0, slots[i]] if int(accepted[i]) == 0 else state_after[i]
        assert torch.equal(live[0, slots[i]], want), f"request {i} accepted {int(accepted[i])}"
