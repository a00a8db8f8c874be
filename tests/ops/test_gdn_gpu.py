"""CUDA GDN kernels against the pure-torch reference, and bitwise among themselves:
verify rows == decode outputs, verify leaves the state alone, replay of n rows == n decodes."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import gdn_inputs, random_state

from deltaserve.ops import GDNStash, gdn_decode, gdn_prefill, gdn_replay, gdn_verify
from deltaserve.ops._ext import extension_loaded
from deltaserve.ops.gdn import gdn_decode_ref, gdn_verify_ref
from deltaserve.ops.gdn_chunk import chunk_gated_delta_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


def _slots(n: int, num_slots: int, seed: int, pad_every: int = 0) -> torch.Tensor:
    """n distinct slots in random order (from 1..num_slots-1), every pad_every-th one slot 0."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(num_slots - 1, generator=gen)[:n] + 1
    if pad_every:
        slots[::pad_every] = 0
    return slots.int().to(DEV)


@pytest.mark.parametrize("kd,h,hv", [(32, 4, 8), (64, 4, 4), (128, 4, 8), (128, 2, 8),
                                     (256, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decode_matches_the_reference_with_shuffled_and_padding_slots(kd, h, hv, dtype):
    n = 13
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(n, None, h, hv, kd, kd, seed=1, dtype=dtype,
                                               device=DEV)
    pool = random_state(20, hv, kd, kd, seed=2, device=DEV)
    ref = pool.clone()
    slots = _slots(n, 20, seed=3, pad_every=4)
    real = (slots != 0).nonzero().flatten()
    for _ in range(3):
        o = gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, kd ** -0.5)
        o_ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, ref, slots, kd ** -0.5)
        tol = 2e-2 if dtype is torch.bfloat16 else 1e-4
        torch.testing.assert_close(o[real], o_ref[real], atol=tol, rtol=tol)
    keep = slots[real].long()
    torch.testing.assert_close(pool[keep], ref[keep], atol=1e-4, rtol=1e-4)
    untouched = torch.ones(20, dtype=torch.bool)
    untouched[slots.long().cpu()] = False
    assert torch.equal(pool[untouched.to(DEV)], ref[untouched.to(DEV)])


@pytest.mark.parametrize("n", [1, 64, 1024])
def test_decode_at_large_batches_equals_decode_in_pieces(n):
    h, hv, kd = 16, 32, 128
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(n, None, h, hv, kd, kd, seed=n,
                                               dtype=torch.bfloat16, device=DEV)
    pool = random_state(n + 1, hv, kd, kd, seed=5, device=DEV)
    pieces = pool.clone()
    slots = _slots(n, n + 1, seed=6)
    o = gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, slots, kd ** -0.5)
    for i in range(0, n, 100):
        sl = slice(i, i + 100)
        o_i = gdn_decode(q[sl], k[sl], v[sl], a[sl], b[sl], A_log, dt_bias, pieces, slots[sl],
                         kd ** -0.5)
        assert torch.equal(o[sl], o_i)
    assert torch.equal(pool, pieces)
    ref = random_state(n + 1, hv, kd, kd, seed=5, device=DEV)
    o_ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, ref, slots, kd ** -0.5)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(pool, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tiles", ["1", "2", "3", "8"])  # 3: a short last block per key head
def test_decode_and_replay_give_the_same_bits_for_any_tiles_per_block(tiles, monkeypatch):
    h, hv, kd, n, rows, layers = 16, 32, 128, 24, 4, 2
    ins = [gdn_inputs(n, rows, h, hv, kd, kd, seed=30 + i, dtype=torch.bfloat16, device=DEV)
           for i in range(layers)]
    pool = random_state(n + 1, hv, kd, kd, seed=31, layers=layers, device=DEV)
    slots = _slots(n, n + 1, seed=32)
    accepted = torch.tensor([i % (rows + 1) for i in range(n)], dtype=torch.int32)
    stash = GDNStash.allocate(layers, n, rows, h, hv, kd, kd, DEV)
    for layer, x in enumerate(ins):
        gdn_verify(*x, pool[layer], slots, kd ** -0.5, stash, layer)

    def run(env):
        if env is None:
            monkeypatch.delenv("DS_GDN_TILES", raising=False)
        else:
            monkeypatch.setenv("DS_GDN_TILES", env)
        dec, rep = pool.clone(), pool.clone()
        outs = _decode_steps(ins, dec, slots, accepted)
        gdn_replay(stash, rep, slots, accepted.to(DEV))
        return dec, rep, [o for layer_outs in outs for _, o in layer_outs]

    dec, rep, outs = run(tiles)
    dec0, rep0, outs0 = run(None)
    assert torch.equal(dec, dec0) and torch.equal(rep, rep0) and torch.equal(dec, rep)
    assert all(torch.equal(o, o0) for o, o0 in zip(outs, outs0))


def _decode_steps(ins, pool, slots, rows_per_req):
    """rows_per_req[i] gdn_decode steps for request i, in every layer; returns outputs per row."""
    outs = []
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        layer_outs = []
        for r in range(int(rows_per_req.max())):
            sel = (rows_per_req > r).nonzero().flatten().to(DEV)
            o = gdn_decode(q[sel, r], k[sel, r], v[sel, r], a[sel, r], b[sel, r], A_log, dt_bias,
                           pool[layer], slots[sel], q.shape[-1] ** -0.5)
            layer_outs.append((sel, o))
        outs.append(layer_outs)
    return outs


@pytest.mark.parametrize("kd,h,hv,rows", [(128, 2, 4, 8), (64, 1, 2, 4), (256, 2, 2, 3),
                                          (128, 16, 32, 5), (32, 4, 8, 4)])
def test_replay_of_n_rows_equals_n_decode_steps_bitwise_for_every_n(kd, h, hv, rows):
    layers, n = 3, rows + 3  # the last two requests are padding (slot 0)
    ins = [gdn_inputs(n, rows, h, hv, kd, kd, seed=10 * i + rows, dtype=torch.bfloat16,
                      device=DEV) for i in range(layers)]
    pool = random_state(n + 4, hv, kd, kd, seed=7, layers=layers, device=DEV)
    slots = torch.cat([_slots(n - 2, n + 4, seed=8), torch.zeros(2, dtype=torch.int32,
                                                                 device=DEV)])
    accepted = torch.tensor([i % (rows + 1) for i in range(n)], dtype=torch.int32)  # 0..R
    stash = GDNStash.allocate(layers, n + 2, rows + 1, h, hv, kd, kd, DEV)
    live = pool.clone()
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        gdn_verify(q, k, v, a, b, A_log, dt_bias, live[layer], slots, kd ** -0.5, stash, layer)
    assert torch.equal(live, pool), "verify must not write the state"
    gdn_replay(stash, live, slots, accepted.to(DEV))
    expect = pool.clone()
    _decode_steps(ins, expect, slots, accepted)
    assert torch.equal(live[:, 1:], expect[:, 1:])


@pytest.mark.parametrize("kd,h,hv", [(128, 16, 32), (64, 2, 2), (256, 1, 4), (32, 4, 8)])
@pytest.mark.parametrize("rows", [1, 4, 9])  # 9: two staged chunks of rows
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_verify_rows_equal_stepwise_decode_outputs_bitwise(kd, h, hv, rows, dtype):
    n = 9
    (q, k, v, a, b, A_log, dt_bias) = gdn_inputs(n, rows, h, hv, kd, kd, seed=11 + rows,
                                                 dtype=dtype, device=DEV)
    pool = random_state(12, hv, kd, kd, seed=12, device=DEV)
    slots = _slots(n, 12, seed=13)
    stash = GDNStash.allocate(1, n, rows, h, hv, kd, kd, DEV)
    before = pool.clone()
    o = gdn_verify(q, k, v, a, b, A_log, dt_bias, pool, slots, kd ** -0.5, stash, 0)
    assert torch.equal(pool, before)
    steps = _decode_steps([(q, k, v, a, b, A_log, dt_bias)], pool[None].clone(), slots,
                          torch.full((n,), rows))
    for r, (_, o_dec) in enumerate(steps[0]):
        assert torch.equal(o[:, r], o_dec), f"row {r}"
    stash_ref = GDNStash.allocate(1, n, rows, h, hv, kd, kd, DEV)
    o_ref = gdn_verify_ref(q, k, v, a, b, A_log, dt_bias, before.clone(), slots, kd ** -0.5,
                           stash_ref, 0)
    ref_tol = 1e-4 if dtype is torch.float32 else 2e-2
    torch.testing.assert_close(o.float(), o_ref.float(), atol=ref_tol, rtol=ref_tol)
    for name in ("k", "v", "g", "beta"):
        torch.testing.assert_close(getattr(stash, name), getattr(stash_ref, name), atol=1e-5,
                                   rtol=1e-5)


# Qwen3-Next shapes: 4 and 8 row tiles per verify block at n = 32 and 64; at 64 with R = 4 a
# block spans two key heads (16 tiles); at 96 with R = 4 verify takes 4 rows per thread on an
# H200 (pick_verify_rows), and "4" forces them (and in decode and replay) at every size.
@pytest.mark.parametrize("n,rows,rows_per_thread", [
    (32, 4, None), (32, 9, None), (64, 4, None), (64, 9, None), (96, 4, None),
    (32, 4, "4"), (64, 4, "4"), (64, 9, "4")])  # 9: q, k restaged for every tile and chunk
def test_verify_blocks_over_several_tiles_equal_stepwise_decode_and_replay(n, rows,
                                                                           rows_per_thread,
                                                                           monkeypatch):
    if rows_per_thread is not None:
        monkeypatch.setenv("DS_GDN_ROWS", rows_per_thread)
    h, hv, kd = 16, 32, 128
    ins = [gdn_inputs(n, rows, h, hv, kd, kd, seed=20 + rows, dtype=torch.bfloat16, device=DEV)]
    pool = random_state(n + 1, hv, kd, kd, seed=21, device=DEV)
    slots = _slots(n, n + 1, seed=22)
    stash = GDNStash.allocate(1, n, rows, h, hv, kd, kd, DEV)
    live = pool.clone()
    o = gdn_verify(*ins[0], live, slots, kd ** -0.5, stash, 0)
    assert torch.equal(live, pool)
    steps = _decode_steps(ins, pool[None].clone(), slots, torch.full((n,), rows))
    for r, (_, o_dec) in enumerate(steps[0]):
        assert torch.equal(o[:, r], o_dec), f"row {r}"
    accepted = torch.tensor([i % (rows + 1) for i in range(n)], dtype=torch.int32)
    gdn_replay(stash, live[None], slots, accepted.to(DEV))
    expect = pool[None].clone()
    _decode_steps(ins, expect, slots, accepted)
    assert torch.equal(live, expect[0])


@pytest.mark.parametrize("kd,vd,h,hv", [(128, 100, 2, 4), (64, 40, 1, 2), (64, 40, 3, 6)])
@pytest.mark.parametrize("tiles", [None, "2", "3", "16+2"])
def test_value_rows_off_the_tile_grid_keep_decode_verify_and_replay_bitwise(kd, vd, h, hv, tiles,
                                                                            monkeypatch):
    """V not a multiple of the row tile: each value head ends in a short tile, next to the next
    head's first one (G = 2), in decode's per-thread row inputs and in verify's staged ones.
    "16+2": verify blocks of two whole key heads (h = 3: the last block holds one)."""
    if tiles is not None:
        tiles, _, key_heads = tiles.partition("+")
        monkeypatch.setenv("DS_GDN_TILES", tiles)
        if key_heads:
            monkeypatch.setenv("DS_GDN_KEY_HEADS", key_heads)
    n, rows = 10, 4
    ins = gdn_inputs(n, rows, h, hv, kd, vd, seed=40, dtype=torch.bfloat16, device=DEV)
    pool = random_state(n + 1, hv, vd, kd, seed=41, device=DEV)
    slots = _slots(n, n + 1, seed=42)
    stash = GDNStash.allocate(1, n, rows, h, hv, kd, vd, DEV)
    live = pool.clone()
    o = gdn_verify(*ins, live, slots, kd ** -0.5, stash, 0)
    assert torch.equal(live, pool)
    steps = _decode_steps([ins], pool[None].clone(), slots, torch.full((n,), rows))
    for r, (_, o_dec) in enumerate(steps[0]):
        assert torch.equal(o[:, r], o_dec), f"row {r}"
    accepted = torch.tensor([i % (rows + 1) for i in range(n)], dtype=torch.int32)
    gdn_replay(stash, live[None], slots, accepted.to(DEV))
    expect = pool[None].clone()
    _decode_steps([ins], expect, slots, accepted)
    assert torch.equal(live, expect[0])
    q, k, v, a, b, A_log, dt_bias = (x[:, 0] if x.dim() > 1 else x for x in ins)
    dec, ref = pool.clone(), pool.clone()
    o_dec = gdn_decode(q, k, v, a, b, A_log, dt_bias, dec, slots, kd ** -0.5)
    o_ref = gdn_decode_ref(q, k, v, a, b, A_log, dt_bias, ref, slots, kd ** -0.5)
    torch.testing.assert_close(o_dec.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(dec, ref, atol=1e-4, rtol=1e-4)


def test_state_pools_over_2_pow_31_elements_use_64_bit_offsets():
    h, hv, kd = 16, 32, 128
    per_slot = hv * kd * kd
    num_slots = 2 ** 31 // per_slot + 4  # > 2^31 fp32 elements (8.6 GB)
    pool = torch.empty(num_slots, hv, kd, kd, device=DEV)
    far = torch.tensor([num_slots - 1, num_slots - 3, 1], dtype=torch.int32, device=DEV)
    small = random_state(3, hv, kd, kd, seed=14, device=DEV)
    pool[far.long()] = small
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(3, None, h, hv, kd, kd, seed=15,
                                               dtype=torch.bfloat16, device=DEV)
    o = gdn_decode(q, k, v, a, b, A_log, dt_bias, pool, far, kd ** -0.5)
    o_small = gdn_decode(q, k, v, a, b, A_log, dt_bias, small,
                         torch.arange(3, dtype=torch.int32, device=DEV), kd ** -0.5)
    assert torch.equal(o, o_small)
    assert torch.equal(pool[far.long()], small)
    del pool
    layers = 2
    big = torch.empty(layers, num_slots // 2 + 2, hv, kd, kd, device=DEV)  # > 2^31 in total
    slot = big.shape[1] - 1
    big[:, slot] = small[0]
    ref = small[:1][None].repeat(layers, 1, 1, 1, 1)
    ins = [gdn_inputs(1, 2, h, hv, kd, kd, seed=16 + i, dtype=torch.bfloat16, device=DEV)
           for i in range(layers)]
    stash = GDNStash.allocate(layers, 1, 2, h, hv, kd, kd, DEV)
    one = torch.tensor([slot], dtype=torch.int32, device=DEV)
    for layer, (q, k, v, a, b, A_log, dt_bias) in enumerate(ins):
        gdn_verify(q, k, v, a, b, A_log, dt_bias, big[layer], one, kd ** -0.5, stash, layer)
    gdn_replay(stash, big, one, torch.tensor([2], dtype=torch.int32, device=DEV))
    _decode_steps(ins, ref, torch.zeros(1, dtype=torch.int32, device=DEV), torch.tensor([2]))
    assert torch.equal(big[:, slot], ref[:, 0])


def test_prefill_on_cuda_matches_the_chunked_reference_in_our_state_layout():
    h, hv, kd, lengths = 2, 4, 128, [1, 100, 63, 300]
    t = sum(lengths)
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(t, None, h, hv, kd, kd, seed=17,
                                               dtype=torch.bfloat16, device=DEV)
    from deltaserve.ops import gdn_gates
    from deltaserve.ops.gdn import _heads, _l2norm

    g, beta = gdn_gates(a, b, A_log, dt_bias)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    init = random_state(len(lengths), hv, kd, kd, seed=18, device=DEV)
    o, final = gdn_prefill(q, k, v, g, beta, init, cu, kd ** -0.5)
    o_ref, final_ref = chunk_gated_delta_ref(_heads(_l2norm(q) * kd ** -0.5, hv),
                                             _heads(_l2norm(k), hv), v, g, beta, init, cu)
    # fla-core runs its matmuls in bf16: loose tolerances; a transposed state would be far off.
    torch.testing.assert_close(o.float(), o_ref.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(final, final_ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("kd,h,hv,n,rows", [(128, 16, 32, 24, 4), (128, 16, 32, 64, 4),
                                            (128, 16, 32, 2, 4),
                                            (64, 2, 4, 5, 8), (256, 1, 2, 3, 3),
                                            (32, 4, 8, 40, 2), (128, 2, 8, 300, 1)])
@pytest.mark.parametrize("rows_per_thread", [None, "4"])
def test_verify_with_pending_rows_equals_replay_then_verify_bitwise(kd, h, hv, n, rows,
                                                                   rows_per_thread, monkeypatch):
    """gdn_replay_verify (one launch) == gdn_replay of that layer, then gdn_verify: the same
    outputs, stash and state bits, for one-tile and multi-tile blocks (and with 4 rows per
    thread forced, which no default launch takes with pending rows)."""
    if rows_per_thread is not None:
        monkeypatch.setenv("DS_GDN_ROWS", rows_per_thread)
    layers = 2
    first = [gdn_inputs(n, rows, h, hv, kd, kd, seed=40 + i, dtype=torch.bfloat16, device=DEV)
             for i in range(layers)]
    second = [gdn_inputs(n, rows, h, hv, kd, kd, seed=50 + i, dtype=torch.bfloat16, device=DEV)
              for i in range(layers)]
    pool = random_state(n + 3, hv, kd, kd, seed=41, layers=layers, device=DEV)
    slots = torch.cat([_slots(n - 1, n + 3, seed=42), torch.zeros(1, dtype=torch.int32,
                                                                 device=DEV)])
    prev = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, kd, DEV)
    for layer, x in enumerate(first):
        gdn_verify(*x, pool[layer], slots, kd ** -0.5, prev, layer)
    accepted = torch.tensor([(3 * i) % (rows + 1) for i in range(n)], dtype=torch.int32,
                            device=DEV)
    fused, split = pool.clone(), pool.clone()
    st_f = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, kd, DEV)
    st_s = GDNStash.allocate(layers, n + 1, rows, h, hv, kd, kd, DEV)
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
