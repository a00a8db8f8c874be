"""The CUDA kernels' own code, run on the CPU by the emulated device runtime (kernels_emu.py),
held to the contracts the GPU tests check: against the pure-torch references, and bitwise among
themselves (verify rows == decode outputs, verify leaves the state and the conv window alone,
replay of n rows == n decode steps, commit == n updates). Shapes are small (the emulator runs a
block's threads as fibers, milliseconds per block) but reach each launch path: 1, 2 and 4 value
rows per thread, one and several tiles per block, rows over one staged chunk, value heads off
the tile grid, HV/H = 1, 2, 4, K = 32..256, padding slot 0 repeated, slots in any order.
These run everywhere, CI included; the GPU tests (test_*_gpu.py) still own the real hardware
(its float bits, large batches, > 2^31-element pools, PDL)."""

from __future__ import annotations

import kernels_emu
import pytest
import torch
from ops_helpers import gdn_inputs, random_state

from deltaserve.ops import (
    GDNStash,
    causal_conv1d_commit,
    causal_conv1d_prefill,
    causal_conv1d_update,
    causal_conv1d_verify,
    gdn_decode,
    gdn_replay,
    gdn_verify,
)
from deltaserve.ops.conv1d import conv1d_prefill_ref, conv1d_update_ref, conv1d_verify_ref
from deltaserve.ops.gdn import gdn_decode_ref, gdn_verify_ref

W = 4


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    ops = kernels_emu.emulate(monkeypatch)
    yield
    assert ops.calls > 0, "the wrappers ran the reference, not the emulated kernels"


def _slots(n: int, num_slots: int, seed: int, pad_every: int = 0) -> torch.Tensor:
    """n distinct slots in random order (from 1..num_slots-1), every pad_every-th one slot 0."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    if pad_every:
        slots[::pad_every] = 0
    return slots.int()


def _decode_steps(ins, pool, slots, rows_per_req):
    """rows_per_req[i] gdn_decode steps for request i in every layer; outputs per layer, row."""
    outs = []
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        layer_outs = []
        for r in range(int(rows_per_req.max())):
            sel = (rows_per_req > r).nonzero().flatten()
            layer_outs.append(gdn_decode(q[sel, r], k[sel, r], v[sel, r], a[sel, r], b[sel, r],
                                         A_log, dt_bias, pool[layer], slots[sel],
                                         q.shape[-1] ** -0.5))
        outs.append(layer_outs)
    return outs


def _tuning(monkeypatch, rows: str | None, tiles: str | None, key_heads: str | None = None) -> None:
    """Force the launch's rows per thread, tiles per block and key heads per verify block (None:
    the heuristics'). tiles "16" with key_heads "2": a verify block spans two whole key heads."""
    for name, value in (("DS_GDN_ROWS", rows), ("DS_GDN_TILES", tiles),
                        ("DS_GDN_KEY_HEADS", key_heads)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)


@pytest.mark.parametrize("kd,vd,h,hv", [(32, 32, 4, 8), (64, 40, 1, 4), (128, 64, 2, 2),
                                        (256, 32, 1, 2)])
@pytest.mark.parametrize("rows", ["1", "2", "4"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_emulated_decode_matches_the_reference(kd, vd, h, hv, rows, dtype, monkeypatch):
    _tuning(monkeypatch, rows, None)
    n = 5
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(n, None, h, hv, kd, vd, seed=1, dtype=dtype)
    pool = random_state(9, hv, vd, kd, seed=2)
    ref = pool.clone()
    slots = _slots(n, 9, seed=3, pad_every=2)  # slot 0 three times
    real = (slots != 0).nonzero().flatten()
    for _ in range(2):
        o = gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, kd ** -0.5)
        o_ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, ref, slots, kd ** -0.5)
        tol = 1e-4 if dtype is torch.float32 else 2e-2
        torch.testing.assert_close(o[real], o_ref[real], atol=tol, rtol=tol)
    keep = slots[real].long()
    torch.testing.assert_close(pool[keep], ref[keep], atol=1e-5, rtol=1e-5)
    untouched = torch.ones(9, dtype=torch.bool)
    untouched[slots.long()] = False
    assert torch.equal(pool[untouched], ref[untouched])


@pytest.mark.parametrize("kd,vd,h,hv", [(32, 48, 2, 4), (128, 40, 1, 2), (64, 64, 2, 2),
                                        (256, 16, 1, 4), (64, 40, 3, 6)])
@pytest.mark.parametrize("rows,tiles,key_heads", [
    (1, None, None), (4, None, None), (4, "1", None), (4, "3", None), (9, None, None),
    ("2", "2", None), (4, "16", "2"), (3, "16", "2"), ("2", "16", "2")])
def test_emulated_verify_rows_equal_decode_bitwise_and_replay_equals_n_decodes(kd, vd, h, hv,
                                                                               rows, tiles,
                                                                               key_heads,
                                                                               monkeypatch):
    """rows "2": R = 4 with 2 value rows per thread forced (else the heuristic's 1 here); key
    heads "2": blocks of two whole key heads where H > 1 (h = 3: the last block holds one)."""
    if isinstance(rows, str):
        _tuning(monkeypatch, rows, tiles, key_heads)
        rows = 4
    else:
        _tuning(monkeypatch, None, tiles, key_heads)
    n, layers = 4, 2
    ins = [gdn_inputs(n, rows, h, hv, kd, vd, seed=10 + i, dtype=torch.bfloat16)
           for i in range(layers)]
    pool = random_state(n + 2, hv, vd, kd, seed=11, layers=layers)
    slots = torch.cat([_slots(n - 1, n + 2, seed=12), torch.zeros(1, dtype=torch.int32)])
    stash = GDNStash.allocate(layers, n, rows, h, hv, kd, vd, "cpu")
    live = pool.clone()
    outs = [gdn_verify(*x, live[layer], slots, kd ** -0.5, stash, layer)
            for layer, x in enumerate(ins)]
    assert torch.equal(live, pool), "verify must not write the state"
    steps = _decode_steps(ins, pool.clone(), slots, torch.full((n,), rows))
    for layer in range(layers):
        for r, o_dec in enumerate(steps[layer]):
            assert torch.equal(outs[layer][:-1, r], o_dec[:-1]), f"layer {layer}, row {r}"
    stash_ref = GDNStash.allocate(1, n, rows, h, hv, kd, vd, "cpu")
    o_ref = gdn_verify_ref(*ins[0], pool[0].clone(), slots, kd ** -0.5, stash_ref, 0)
    torch.testing.assert_close(outs[0][:-1].float(), o_ref[:-1].float(), atol=2e-2, rtol=2e-2)
    for name in ("k", "v", "g", "beta"):
        torch.testing.assert_close(getattr(stash, name)[:1, :-1],
                                   getattr(stash_ref, name)[:, :-1], atol=1e-5, rtol=1e-5)
    accepted = torch.tensor([(i * 3) % (rows + 1) for i in range(n)], dtype=torch.int32)
    gdn_replay(stash, live, slots, accepted)
    expect = pool.clone()
    _decode_steps(ins, expect, slots, accepted)
    assert torch.equal(live[:, 1:], expect[:, 1:])


@pytest.mark.parametrize("kd,vd,h,hv,n,rows", [(64, 64, 2, 4, 3, 4), (32, 32, 4, 8, 5, 8),
                                               (128, 48, 1, 2, 2, 3), (256, 32, 1, 1, 2, 2),
                                               (64, 40, 3, 6, 3, 3)])
@pytest.mark.parametrize("tiles", [None, "1", "2"])
def test_emulated_verify_with_pending_rows_equals_replay_then_verify_bitwise(kd, vd, h, hv, n,
                                                                             rows, tiles,
                                                                             monkeypatch):
    _tuning(monkeypatch, None, tiles)
    layers = 2
    first = [gdn_inputs(n, rows, h, hv, kd, vd, seed=40 + i, dtype=torch.bfloat16)
             for i in range(layers)]
    second = [gdn_inputs(n, rows, h, hv, kd, vd, seed=50 + i, dtype=torch.bfloat16)
              for i in range(layers)]
    pool = random_state(n + 3, hv, vd, kd, seed=41, layers=layers)
    slots = torch.cat([_slots(n - 1, n + 3, seed=42), torch.zeros(1, dtype=torch.int32)])
    prev = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, vd, "cpu")
    for layer, x in enumerate(first):
        gdn_verify(*x, pool[layer], slots, kd ** -0.5, prev, layer)
    accepted = torch.tensor([(3 * i + 1) % (rows + 1) for i in range(n)], dtype=torch.int32)
    fused, split = pool.clone(), pool.clone()
    st_f = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, vd, "cpu")
    st_s = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, vd, "cpu")
    gdn_replay(prev, split, slots, accepted)
    for layer, x in enumerate(second):
        o_f = gdn_verify(*x, fused[layer], slots, kd ** -0.5, st_f, layer,
                         pending=(prev, accepted))
        o_s = gdn_verify(*x, split[layer], slots, kd ** -0.5, st_s, layer)
        assert torch.equal(o_f[:-1], o_s[:-1]), f"layer {layer}"
    assert torch.equal(fused[:, 1:], split[:, 1:])
    for name in ("k", "v", "g", "beta"):
        assert torch.equal(getattr(st_f, name)[:, :n - 1], getattr(st_s, name)[:, :n - 1])
    untouched = pool.clone()
    untouched[:, slots.long()] = fused[:, slots.long()]
    assert torch.equal(fused, untouched), "only the batch's slots are written"


def _conv_setup(d, num_slots, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    weight = (torch.randn(d, W, generator=gen) * 0.5).to(dtype)
    bias = (torch.randn(d, generator=gen) * 0.1).to(dtype)
    state = torch.randn(num_slots, W - 1, d, generator=gen).to(dtype)
    return gen, weight, bias, state


@pytest.mark.parametrize("n", [1, 3, 40])  # 40: the unsplit launch shapes at 132 SMs
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_emulated_conv_update_matches_the_reference(n, dtype):
    d = 1024
    gen, weight, bias, state = _conv_setup(d, n + 1, dtype, seed=n)
    x = torch.randn(n, d, generator=gen).to(dtype)
    slots = _slots(n, n + 1, seed=1, pad_every=3 if n > 2 else 0)
    ref = state.clone()
    y = causal_conv1d_update(x, weight, bias, state, slots)
    y_ref = conv1d_update_ref(x, weight, bias, ref, slots)
    real = (slots != 0).nonzero().flatten()
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(y[real], y_ref[real], atol=tol, rtol=tol)
    assert torch.equal(state[1:], ref[1:])


@pytest.mark.parametrize("n", [1, 2, 30, 200])  # split rows; loaded ahead; 1.5 and 3 waves
@pytest.mark.parametrize("rows", [1, 4, 8])
@pytest.mark.parametrize("bias_on", [True, False])
def test_emulated_conv_verify_equals_stepwise_updates_and_commit_equals_n_updates(n, rows,
                                                                                   bias_on):
    d, dtype = 1024, torch.bfloat16
    gen, weight, bias, state = _conv_setup(d, n + 1, dtype, seed=rows)
    bias = bias if bias_on else None
    x = torch.randn(n, rows, d, generator=gen).to(dtype)
    slots = _slots(n, n + 1, seed=2)
    before = state.clone()
    y = causal_conv1d_verify(x, weight, bias, state, slots)
    assert torch.equal(state, before)
    stepped = state.clone()
    for r in range(rows):
        assert torch.equal(y[:, r], causal_conv1d_update(x[:, r], weight, bias, stepped, slots))
    torch.testing.assert_close(y, conv1d_verify_ref(x, weight, bias, before, slots), atol=1e-2,
                               rtol=1e-2)
    accepted = torch.tensor([i % (rows + 1) for i in range(n)], dtype=torch.int32)
    causal_conv1d_commit(x, state, slots, accepted)
    expect = before.clone()
    for i in range(n):
        for r in range(int(accepted[i])):
            causal_conv1d_update(x[i:i + 1, r], weight, bias, expect, slots[i:i + 1])
    assert torch.equal(state, expect)


@pytest.mark.parametrize("lengths", [[1, 2, 0, 70, 5], [300], [33] * 6])
def test_emulated_conv_prefill_matches_the_reference_with_final_and_tracked_windows(lengths):
    d, dtype = 512, torch.bfloat16
    n = len(lengths)
    gen, weight, bias, state = _conv_setup(d, 2 * n + 2, dtype, seed=len(lengths))
    x = torch.randn(sum(lengths), d, generator=gen).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    slots = _slots(n, n + 1, seed=4)
    offsets = torch.tensor([ln // 2 for ln in lengths], dtype=torch.int32)
    track = torch.arange(n + 1, 2 * n + 1, dtype=torch.int32)
    track[::3] = 0  # no tracking for these
    ref = state.clone()
    y = causal_conv1d_prefill(x, weight, bias, state, cu, slots, offsets, track)
    y_ref = conv1d_prefill_ref(x, weight, bias, ref, cu, slots, offsets, track)
    torch.testing.assert_close(y, y_ref, atol=1e-2, rtol=1e-2)
    assert torch.equal(state, ref)


def test_emulated_bindings_refuse_bad_shapes_and_dtypes():
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(2, None, 1, 2, 32, 32, seed=5)
    pool = random_state(3, 2, 32, 32, seed=6)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    ops = kernels_emu.load()
    assert torch.equal(ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool.clone(), slots, 0.1),
                       gdn_decode(q, k, v, a, b, A_log, dt_bias, pool.clone(), slots, 0.1))
    with pytest.raises(RuntimeError, match="state must be"):
        ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool[:, :1], slots, 0.1)
    with pytest.raises(RuntimeError, match="slots must have N entries"):
        ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots[:1], 0.1)
    with pytest.raises(RuntimeError, match="slots must be Int, got Long"):
        ops.gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots.long(), 0.1)


def test_emulated_bindings_refuse_inconsistent_stashes_and_oversized_verify_grids():
    """What the Python wrappers do not check, the bindings do (a fresh reviewer's findings: a
    stash with more key heads than value heads crashed replay with a division by zero, a g of
    the wrong HV was written past its end)."""
    n, rows, h, hv, kd, vd = 2, 3, 2, 4, 32, 32
    x = gdn_inputs(n, rows, h, hv, kd, vd, seed=7)
    pool = random_state(3, hv, vd, kd, seed=8, layers=1)
    slots = torch.tensor([1, 2], dtype=torch.int32)
    accepted = torch.tensor([1, 2], dtype=torch.int32)
    ops = kernels_emu.load()
    st = GDNStash.allocate(1, n, rows, h, hv, kd, vd, "cpu")
    live = pool.clone()
    gdn_verify(*x, live[0], slots, 0.1, st, 0)  # the consistent call goes through
    assert torch.equal(live, pool)
    bad_h = GDNStash.allocate(1, n, rows, 8, hv, kd, vd, "cpu")
    with pytest.raises(RuntimeError, match="HV must be a positive multiple"):
        ops.gdn_replay(bad_h.k, bad_h.v, bad_h.g, bad_h.beta, pool, slots, accepted)
    g1 = st.g[..., :1].contiguous()
    with pytest.raises(RuntimeError, match="g and beta"):
        ops.gdn_verify(*x, pool[0], slots, 0.1, st.k, st.v, g1, g1.clone(), 0)
    with pytest.raises(RuntimeError, match="g and beta"):
        ops.gdn_replay(st.k, st.v, g1, g1.clone(), pool, slots, accepted)
    v_short = st.v[:, :, :rows - 1].contiguous()
    with pytest.raises(RuntimeError, match="must share"):
        ops.gdn_verify(*x, pool[0], slots, 0.1, st.k, v_short, st.g, st.beta, 0)
    with pytest.raises(RuntimeError, match="must not share memory"):
        ops.gdn_replay_verify(*x, pool[0], slots, 0.1, st.k, st.v, st.g, st.beta, 0,
                              st.k, st.v, st.g, st.beta, accepted)
    many = 65536
    big = gdn_inputs(many, 1, 1, 1, kd, vd, seed=9)
    with pytest.raises(RuntimeError, match="at most 65,535 requests"):
        ops.gdn_verify(*big, random_state(2, 1, vd, kd, seed=1),
                       torch.zeros(many, dtype=torch.int32), 0.1, st.k, st.v, st.g, st.beta, 0)


def test_emulated_engine_folds_the_accepted_rows_into_the_next_verify_and_keeps_the_tokens(
        tmp_path):
    """The engine on the emulated kernels (GDN head dims 32, which they take): n-gram
    speculation, whose verify steps apply the previous step's accepted rows in the same launch
    (gdn_replay_verify), gives plain decoding's tokens, and leaves nothing pending."""
    from deltaserve import LLM, SamplingParams
    from deltaserve.model.testing import make_tiny_checkpoint
    from drained import assert_drained
    from token_ids import random_tokens

    ckpt = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=5,
                                    linear_key_head_dim=32, linear_value_head_dim=32))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    batch = [random_tokens(n, seed=n + 7) for n in (9, 40)]
    kw = dict(device="cpu", dtype="float32", num_pages=256, page_size=16, max_running_reqs=4)
    plain = LLM(ckpt, **kw)
    spec = LLM(ckpt, speculative_algorithm="ngram", speculative_num_steps=3,
               speculative_policy="fixed", **kw)
    off = [o.token_ids for o in plain.generate(batch, greedy)]
    on = [o.token_ids for o in spec.generate(batch, greedy)]
    pool = spec.engine.state_pool
    assert pool.n_taken > 0, "no verify took the previous step's rows (gdn_replay_verify)"
    assert not pool.has_pending
    assert on == off
    assert_drained(spec.engine)
