"""gdn_chunk_prefill on the CPU: the reference keeps gdn_prefill's bits, a chained sequence equals
a second call from its predecessor's final state, PrefillIndex holds fla-core's indices, and
the fla-core pipeline (Triton's interpreter, tests/ops/fla_interp.py) matches the reference."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ops_helpers import gdn_inputs, random_state

from deltaserve.ops import gdn_gates, gdn_prefill
from deltaserve.ops.chunk_prefill import PrefillIndex, gdn_chunk_prefill

ROOT = Path(__file__).resolve().parents[2]
H, HV, KD, VD = 2, 4, 16, 8


def packed(t: int, seed: int):
    q, k, v, a, b, A_log, dt_bias = gdn_inputs(t, None, H, HV, KD, VD, seed=seed)
    return q, k, v, a, b, A_log, dt_bias


def test_unchained_prefill_keeps_the_bits_of_gdn_prefill_with_its_gates():
    bounds = [0, 70, 75, 200]
    q, k, v, a, b, A_log, dt_bias = packed(bounds[-1], seed=1)
    h0 = random_state(3, HV, VD, KD, seed=2)
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, PrefillIndex.build(bounds),
                                 KD ** -0.5)
    g, beta = gdn_gates(a, b, A_log, dt_bias)
    o_ref, final_ref = gdn_prefill(q, k, v, g, beta, h0, torch.tensor(bounds, dtype=torch.int32),
                                   KD ** -0.5)
    assert torch.equal(o, o_ref) and torch.equal(final, final_ref)


@pytest.mark.parametrize("split", [64, 100, 1])
def test_a_chained_sequence_equals_a_second_call_from_the_first_ones_final_state(split):
    # request 0 is split at `split` rows into two chained sequences; request 1 is plain
    n0, n1 = 150, 40
    q, k, v, a, b, A_log, dt_bias = packed(n0 + n1, seed=3)
    h0 = random_state(2, HV, VD, KD, seed=4)
    index = PrefillIndex.build([0, split, n0, n0 + n1], [False, True, False])
    init = torch.stack([h0[0], torch.full_like(h0[0], float("nan")), h0[1]])  # row 1 unread
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, init, index, KD ** -0.5)

    def call(lo, hi, state):
        return gdn_chunk_prefill(q[lo:hi], k[lo:hi], v[lo:hi], a[lo:hi], b[lo:hi], A_log,
                                 dt_bias, state[None], PrefillIndex.build([0, hi - lo]),
                                 KD ** -0.5)

    o_a, s_a = call(0, split, h0[0])
    o_b, s_b = call(split, n0, s_a[0])
    o_c, s_c = call(n0, n0 + n1, h0[1])
    assert torch.equal(o, torch.cat([o_a, o_b, o_c]))
    assert torch.equal(final, torch.cat([s_a, s_b, s_c]))


def test_prenormalised_q_and_k_give_the_same_bits_in_fp32():
    bounds = [0, 90]
    q, k, v, a, b, A_log, dt_bias = packed(90, seed=5)
    h0 = random_state(1, HV, VD, KD, seed=6)
    index = PrefillIndex.build(bounds)
    o, final = gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, h0, index, KD ** -0.5)
    rs = (q * q).sum(-1, keepdim=True) + 1e-6
    qn = q * torch.rsqrt(rs)
    kn = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    o2, final2 = gdn_chunk_prefill(qn, kn, v, a, b, A_log, dt_bias, h0, index, KD ** -0.5,
                                   qk_normalized=True)
    torch.testing.assert_close(o2, o, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(final2, final, atol=1e-6, rtol=1e-5)


def test_prefill_index_holds_fla_cores_chunk_indices_and_offsets():
    fla_index = pytest.importorskip("fla.ops.utils.index")
    for bounds in ([0, 1], [0, 64], [0, 65, 65, 300], [0, 128, 129, 200, 4000]):
        index = PrefillIndex.build(bounds)
        cu = torch.tensor(bounds)
        assert torch.equal(index.cu_seqlens, cu)
        assert torch.equal(index.chunk_indices, fla_index.prepare_chunk_indices(cu, 64))
        assert torch.equal(index.chunk_offsets, fla_index.prepare_chunk_offsets(cu, 64))
        assert index.waves is None


def test_prefill_index_waves_run_each_chain_after_its_predecessor():
    index = PrefillIndex.build([0, 70, 100, 165, 230, 240], [False, False, True, False, True])
    w = index.waves
    assert (w.first, w.last, w.first_row, w.first_chunk) == (2, 4, 100, 3)
    assert w.cu1.tolist() == [0, 70, 100, 165, 230] and w.off1.tolist() == [0, 2, 3, 5, 7]
    assert w.cu2.tolist() == [100, 165, 230, 240] and w.off2.tolist() == [3, 5, 7, 8]
    # wave 2 rows: cat(initial[2:], wave-1 finals): seq 2 <- final 1, 3 <- initial 3, 4 <- final 3
    assert w.select.tolist() == [3 + 1, 1, 3 + 3]
    # every array starts 16-byte aligned in the one uploaded buffer
    for t in (index.cu_seqlens, index.chunk_indices, index.chunk_offsets, w.cu1, w.off1, w.cu2,
              w.off2, w.select):
        assert t.data_ptr() % 16 == 0


def test_prefill_index_uploads_once():
    uploads = []
    PrefillIndex.build([0, 5, 9], [False, True], upload=lambda a: uploads.append(a) or
                       torch.from_numpy(a))
    assert len(uploads) == 1


@pytest.mark.parametrize(("bounds", "chained", "match"), [
    ([1, 5], None, "rise from 0"),
    ([0, 5, 3], None, "rise from 0"),
    ([0], None, "at least one"),
    ([0, 5], [True], "cannot be chained"),
    ([0, 5, 6, 9], [False, True, True], "cannot be chained"),
    ([0, 5, 5, 9], [False, False, True], "cannot be chained"),
    ([0, 5, 9], [False], "one entry per sequence"),
])
def test_prefill_index_refuses_bad_bounds_and_chains(bounds, chained, match):
    with pytest.raises(ValueError, match=match):
        PrefillIndex.build(bounds, chained)


def test_gdn_chunk_prefill_refuses_an_index_of_other_sizes():
    q, k, v, a, b, A_log, dt_bias = packed(10, seed=7)
    with pytest.raises(ValueError, match="index covers"):
        gdn_chunk_prefill(q, k, v, a, b, A_log, dt_bias, random_state(1, HV, VD, KD, seed=8),
                          PrefillIndex.build([0, 9]), 0.25)


def test_the_fla_core_pipeline_matches_the_reference_under_tritons_interpreter():
    pytest.importorskip("fla")
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH",
                                                                                "")]))
    run = subprocess.run([sys.executable, str(ROOT / "tests/ops/fla_interp.py")], env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [x for x in run.stdout.splitlines() if "ok" in x or "MISMATCH" in x]
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert len(lines) == 5 and all(x.endswith("ok") for x in lines), run.stdout


def test_the_fla_path_reads_nothing_back_from_the_device(monkeypatch):
    """fla-core's stages mocked (shapes only), every way of reading a tensor on the host
    refused: with a PrefillIndex the pipeline derives nothing from tensor values, chained
    batches included (on CUDA each such read would wait for the device)."""
    pytest.importorskip("fla")
    import fla.ops.common.chunk_delta_h as delta_h
    import fla.ops.common.chunk_o as chunk_o
    import fla.ops.gated_delta_rule.chunk_fwd as chunk_fwd
    import fla.ops.gated_delta_rule.gate as gate

    from deltaserve.ops.chunk_prefill import _fla_pipeline

    calls = []

    def fwd_h(k, w, u, g, initial_state, output_final_state, chunk_size, state_v_first,
              cu_seqlens, chunk_indices, chunk_offsets):
        calls.append(("h", cu_seqlens, chunk_offsets, initial_state.shape[0]))
        n, hv, vd, kd = cu_seqlens.shape[0] - 1, u.shape[2], u.shape[3], k.shape[3]
        return (k.new_zeros(1, chunk_indices.shape[0], hv, vd, kd), torch.zeros_like(u),
                torch.zeros(n, hv, vd, kd))

    monkeypatch.setattr(gate, "gdn_gate_chunk_cumsum",
                        lambda g, **kw: calls.append("gate") or torch.zeros(g.shape))
    monkeypatch.setattr(chunk_fwd, "chunk_gated_delta_rule_fwd_intra",
                        lambda k, v, g, beta, **kw: (torch.zeros(*v.shape[:3], k.shape[-1]),
                                                     torch.zeros_like(v), None))
    monkeypatch.setattr(delta_h, "chunk_gated_delta_rule_fwd_h", fwd_h)
    monkeypatch.setattr(chunk_o, "chunk_fwd_o", lambda q, k, v, **kw: torch.zeros_like(v))
    q, k, v, a, b, A_log, dt_bias = packed(300, seed=9)
    for name in ("item", "tolist", "numpy", "cpu", "__bool__", "__int__", "__index__",
                 "__float__"):
        monkeypatch.setattr(torch.Tensor, name, _refuse(name))
    for chained in ([False, False, False], [False, True, False], [False, False, True]):
        index = PrefillIndex.build([0, 100, 250, 300], chained)
        calls.clear()
        o, final = _fla_pipeline(q, k, v, torch.zeros(300, HV), KD ** -0.5,
                                 torch.zeros(3, HV, VD, KD), index, gate=(a, A_log, dt_bias))
        assert o.shape == v.shape and final.shape == (3, HV, VD, KD)
        waves = [c for c in calls if c[0] == "h"]
        assert len(waves) == (2 if any(chained) else 1) and calls[0] == "gate"
        if any(chained):  # wave 1 up to the chained one, wave 2 from it on
            j = chained.index(True)
            assert waves[0][3] == j and waves[1][3] == 3 - j
            assert waves[0][1] is index.waves.cu1 and waves[1][2] is index.waves.off2


def _refuse(name):
    def method(*args, **kwargs):
        raise AssertionError(f"Tensor.{name} read a tensor back on the host")
    return method
