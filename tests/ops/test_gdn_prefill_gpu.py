"""gdn_chunk_prefill on CUDA (fla-core's stages called one by one): bit for bit fla's public
chunk_gated_delta_rule, a chained sequence bit for bit a second call from its predecessor's
final state, close to the torch reference, the layers of a forward replayed bit for bit, and no
host synchronisation in a call."""

from __future__ import annotations

import pytest
import torch
from ops_helpers import gdn_inputs, random_state

from deltaserve.ops.chunk_prefill import PrefillIndex, gdn_chunk_prefill, gdn_chunk_prefill_ref

pytestmark = pytest.mark.gpu
DEV = "cuda"
# (H, HV, K=V): the 0.8B config's, and a small one (each new shape compiles and autotunes
# fla-core's kernels once per process: a few seconds each)
SHAPES = [(16, 16, 128), (4, 8, 32)]


@pytest.fixture(autouse=True)
def _replays_on_again():
    """A failed capture turns replays off for the process (ops/chunk_graph.py): each test here
    starts with them on, so one failure does not pass for every test after it."""
    from deltaserve.ops import chunk_graph

    chunk_graph._state.update(failed=False, warm=True)
    yield


def inputs(t: int, h: int, hv: int, kd: int, seed: int):
    return gdn_inputs(t, None, h, hv, kd, kd, seed=seed, dtype=torch.bfloat16, device=DEV)


@pytest.mark.parametrize(("h", "hv", "kd"), SHAPES)
def test_the_staged_pipeline_gives_the_bits_of_flas_public_entry_point(h, hv, kd):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    bounds = [0, 1, 101, 164, 464]
    q, k, v, a, b, A_log, dt_bias = inputs(bounds[-1], h, hv, kd, seed=1)
    h0 = random_state(len(bounds) - 1, hv, kd, kd, seed=2, device=DEV)
    scale = kd ** -0.5
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0,
                                 PrefillIndex.build(bounds, device=DEV), scale)
    o_api, final_api = chunk_gated_delta_rule(
        q[None], k[None], v[None], a[None], torch.sigmoid(b.float())[None], scale=scale,
        initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True,
        use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, state_v_first=True,
        cu_seqlens=torch.tensor(bounds, device=DEV))
    assert torch.equal(o, o_api[0])
    assert torch.equal(final, final_api)


@pytest.mark.parametrize(("h", "hv", "kd"), SHAPES)
@pytest.mark.parametrize("split", [64, 192, 37])
def test_a_chained_sequence_gives_the_bits_of_a_second_call(h, hv, kd, split):
    n0, n1 = 256, 77
    q, k, v, a, b, A_log, dt_bias = inputs(n0 + n1, h, hv, kd, seed=3)
    h0 = random_state(2, hv, kd, kd, seed=4, device=DEV)
    index = PrefillIndex.build([0, n1, n1 + split, n1 + n0], [False, False, True], device=DEV)
    # request 1 (rows n1..) is split at `split`; request 0 runs alongside it
    init = torch.stack([h0[1], h0[0], torch.full_like(h0[0], float("nan"))])
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, init, index, kd ** -0.5)

    def call(lo, hi, state):
        return gdn_chunk_prefill(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], A_log,
                                 dt_bias, state[None], PrefillIndex.build([0, hi - lo],
                                                                          device=DEV),
                                 kd ** -0.5)

    o_0, s_0 = call(0, n1, h0[1])
    o_a, s_a = call(n1, n1 + split, h0[0])
    o_b, s_b = call(n1 + split, n1 + n0, s_a[0])
    assert torch.equal(o, torch.cat([o_0, o_a, o_b]))
    assert torch.equal(final, torch.cat([s_0, s_a, s_b]))


@pytest.mark.parametrize("chained", [[False, False, False], [False, True, False]])
def test_prefill_matches_the_torch_reference(chained):
    h, hv, kd = 16, 16, 128
    bounds = [0, 150, 300, 301]
    q, k, v, a, b, A_log, dt_bias = inputs(bounds[-1], h, hv, kd, seed=5)
    h0 = random_state(3, hv, kd, kd, seed=6, device=DEV)
    index = PrefillIndex.build(bounds, chained, device=DEV)
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, index, kd ** -0.5)
    o_ref, final_ref = gdn_chunk_prefill_ref(q, k, v, a, b, A_log, dt_bias, h0, index,
                                             kd ** -0.5)
    # fla-core runs its matmuls in bf16: loose tolerances; a wrong chain would be far off
    torch.testing.assert_close(o.float(), o_ref.float(), atol=5e-2, rtol=5e-2)
    torch.testing.assert_close(final, final_ref, atol=2e-2, rtol=2e-2)


def test_a_prefill_call_never_waits_for_the_device(monkeypatch):
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "8192")
    h, hv, kd = 16, 16, 128
    bounds = [0, 192, 256, 300]
    q, k, v, a, b, A_log, dt_bias = inputs(bounds[-1], h, hv, kd, seed=7)
    h0 = random_state(3, hv, kd, kd, seed=8, device=DEV)
    index = PrefillIndex.build(bounds, [False, True, False], device=DEV)
    gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, index, kd ** -0.5)  # autotune first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:  # the second call captures the pipeline (ops/chunk_graph.py), the third replays it
        for _ in range(2):
            gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, index, kd ** -0.5)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def _layer_inputs(t: int, m: int, seed: int, normalized: bool = False):
    """One GDN layer's inputs; normalized: q and k L2-normalised, as the contract of
    qk_normalized=True demands (raw random q, k there overflow to inf / NaN)."""
    h, hv, kd = 16, 16, 128
    q, k, *rest = inputs(t, h, hv, kd, seed=seed)
    if normalized:
        q, k = (torch.nn.functional.normalize(x.float(), dim=-1, eps=1e-6).to(x.dtype)
                for x in (q, k))
    return q, k, *rest, random_state(m, hv, kd, kd, seed=seed + 1, device=DEV)


def _same_bits(x: torch.Tensor, y: torch.Tensor) -> bool:
    ints = {2: torch.int16, 4: torch.int32}[x.element_size()]
    return x.shape == y.shape and x.dtype == y.dtype and torch.equal(x.view(ints), y.view(ints))


@pytest.mark.parametrize("qk_normalized", [True, False])
@pytest.mark.parametrize(("bounds", "chained"), [([0, 256], None), ([0, 1, 101, 164, 250], None),
                                                 ([0, 77, 141, 333], [False, False, True])])
def test_the_layers_after_the_first_replay_the_bits_of_eager_calls(bounds, chained,
                                                                   qk_normalized, monkeypatch):
    """One forward's index over five 'layers' of fresh inputs: the first runs eagerly, the
    second captures, the rest replay (ops/chunk_graph.py); each gives the bits of a call
    with replays off, and a call's outputs survive the calls after it."""
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "8192")
    m = len(bounds) - 1
    index = PrefillIndex.build(bounds, chained, device=DEV)
    layers = [_layer_inputs(bounds[-1], m, seed=20 + 2 * i, normalized=qk_normalized)
              for i in range(5)]
    scale = 128 ** -0.5
    got = [gdn_chunk_prefill(*x, index, scale, qk_normalized=qk_normalized) for x in layers]
    (call,) = index.graphs.values()
    assert call.graph is not None and call.calls == 5
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "0")
    for x, (o, final) in zip(layers, got):
        o_eager, final_eager = gdn_chunk_prefill(*x, PrefillIndex.build(bounds, chained,
                                                                        device=DEV),
                                                 scale, qk_normalized=qk_normalized)
        assert torch.isfinite(o_eager).all() and torch.isfinite(final_eager).all()
        assert _same_bits(o, o_eager)
        assert _same_bits(final, final_eager)


@pytest.mark.parametrize(("bounds", "chained"), [([0, 203], None), ([0, 50, 61, 190], None),
                                                 ([0, 90, 170, 301], [False, False, True])])
def test_a_new_length_captures_its_first_layer_once_its_kernels_ran(bounds, chained,
                                                                      monkeypatch):
    """After one forward of a signature class ran eagerly (any token count), a forward of a
    token and sequence count not seen before captures at its first layer (ops/chunk_graph.py)
    and every layer gives the bits of a call with replays off."""
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "8192")
    m = len(bounds) - 1
    warm_bounds = [0, 64 * (m + 1)] if chained is None else [0, 40, 100, 128]
    warm = PrefillIndex.build(warm_bounds, chained if chained is None else [False, False, True],
                              device=DEV)
    gdn_chunk_prefill(*_layer_inputs(warm_bounds[-1], len(warm_bounds) - 1, seed=80,
                                     normalized=True), warm, 128 ** -0.5, qk_normalized=True)
    index = PrefillIndex.build(bounds, chained, device=DEV)
    layers = [_layer_inputs(bounds[-1], m, seed=82 + 2 * i, normalized=True) for i in range(3)]
    got = [gdn_chunk_prefill(*layers[0], index, 128 ** -0.5, qk_normalized=True)]
    (call,) = index.graphs.values()
    assert call.graph is not None and call.calls == 1
    got += [gdn_chunk_prefill(*x, index, 128 ** -0.5, qk_normalized=True) for x in layers[1:]]
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "0")
    for x, (o, final) in zip(layers, got):
        o_eager, final_eager = gdn_chunk_prefill(*x, PrefillIndex.build(bounds, chained,
                                                                        device=DEV),
                                                 128 ** -0.5, qk_normalized=True)
        assert torch.isfinite(o_eager).all() and torch.isfinite(final_eager).all()
        assert _same_bits(o, o_eager)
        assert _same_bits(final, final_eager)


def test_a_new_signature_class_still_runs_its_first_layer_eagerly(monkeypatch):
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "8192")
    from deltaserve.ops import chunk_graph

    index = PrefillIndex.build([0, 77], device=DEV)
    x = _layer_inputs(77, 1, seed=90)
    chunk_graph._warmed.clear()  # as in a fresh process
    gdn_chunk_prefill(*x, index, 0.5)
    (call,) = index.graphs.values()
    assert call.graph is None and call.calls == 1 and call.warm_key in chunk_graph._warmed


def test_a_forward_past_the_token_limit_runs_eagerly(monkeypatch):
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "255")
    index = PrefillIndex.build([0, 256], device=DEV)
    for i in range(3):
        gdn_chunk_prefill(*_layer_inputs(256, 1, seed=40 + 2 * i), index, 128 ** -0.5)
    assert index.graphs == {}


def test_forwards_one_after_another_reuse_the_replay_memory(monkeypatch):
    """Each forward captures its own graph; a dropped forward's graph memory goes back to the
    shared pool and the next capture takes it again, so reserved memory stops growing."""
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "8192")
    reserved = []
    for _ in range(6):
        index = PrefillIndex.build([0, 200, 320], device=DEV)
        for i in range(3):
            gdn_chunk_prefill(*_layer_inputs(320, 2, seed=60 + 2 * i), index, 128 ** -0.5)
        assert next(iter(index.graphs.values())).graph is not None
        del index
        torch.cuda.synchronize()
        reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[1], reserved
