"""The fused norm and gate kernels' own code, run on the CPU by the emulated device runtime
(kernels_emu.py), against the pure-torch references in deltaserve/ops/fused.py: all three
dtypes, the vector path (dense and strided rows) and the element path (rows one element off a
16-byte boundary, or of a length no vector divides), every row shape of the launch (16 or 32
lanes a row, blocks of 128 or 512 threads, 1 to 4 loads a thread). Row counts are small (the
emulator runs a block's threads as fibers); tests/ops/test_fused_gpu.py owns the real sizes."""

from __future__ import annotations

import kernels_emu
import pytest
import torch
from fused_inputs import (
    DTYPES,
    LAYOUTS,
    attention_projection,
    close,
    gdn_projection,
    norm_weight,
    rope,
    rows,
)

from deltaserve.ops import fused

EPS = 1e-6


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    ops = kernels_emu.emulate(monkeypatch)
    yield
    assert ops.calls > 0, "the wrappers ran the reference, not the emulated kernels"


# (T, D): lanes a row 16 / 32 / 32 / 128 / 512 (bf16 vectors); 100 and 1000: no vector fits
# D = 100 for bf16/fp16 and the element path takes 32 and 512 lanes. D = 8192 misaligned is
# past the element path's 2048 (the reference runs: test_fused_args.py).
NORM_CASES = [(t, d, layout) for t, d in [(2, 64), (5, 256), (3, 1024), (2, 2048), (4, 100),
                                          (1, 1000)] for layout in LAYOUTS]
NORM_CASES += [(1, 8192, "dense"), (1, 8192, "strided")]


@pytest.mark.parametrize("t,d,layout", NORM_CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_rms_norm_matches_the_reference(t, d, layout, dtype):
    gen = torch.Generator().manual_seed(d + t)
    x = rows(t, d, dtype, layout, gen, scale=3.0)
    w = norm_weight(d, gen)
    close(fused.rms_norm(x, w, EPS), fused.rms_norm_ref(x, w, EPS))


def test_emulated_rms_norm_takes_1d_4d_and_head_views():
    gen = torch.Generator().manual_seed(7)
    w = norm_weight(64, gen)
    x4 = torch.randn(2, 3, 4, 64, generator=gen).to(torch.bfloat16)
    close(fused.rms_norm(x4, w, EPS), fused.rms_norm_ref(x4, w, EPS))
    x1 = x4[1, 2, 3]
    close(fused.rms_norm(x1, w, EPS), fused.rms_norm_ref(x1, w, EPS))
    q_gate, _ = attention_projection(3, 4, 2, 64, torch.bfloat16, gen)
    q = q_gate[..., :64]  # [T, H, D] with strides (row of the projection, 2D, 1)
    close(fused.rms_norm(q, w, EPS), fused.rms_norm_ref(q, w, EPS))


@pytest.mark.parametrize("t,d", [(3, 1024), (2, 2048), (4, 100), (5, 256)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_add_rms_norm_sum_is_bitwise_and_norm_matches(t, d, layout, dtype):
    gen = torch.Generator().manual_seed(d)
    x = rows(t, d, dtype, layout, gen)
    residual = rows(t, d, dtype, "strided", gen, scale=4.0)
    w = norm_weight(d, gen)
    y, s = fused.add_rms_norm(x, residual, w, EPS)
    y_ref, s_ref = fused.add_rms_norm_ref(x, residual, w, EPS)
    assert s.is_contiguous() and torch.equal(s, s_ref), "s must be the unfused sum, bitwise"
    close(y, y_ref)


# (T, HV, V): the 0.8B config's heads; the default model's (HV 8, V 32); V = 36: the element
# path for 16-bit dtypes (fp32: vectors of 4 fit)
@pytest.mark.parametrize("t,hv,v", [(3, 16, 128), (2, 8, 32), (3, 3, 36)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_gated_rms_norm_over_a_projection_view_matches(t, hv, v, dtype):
    gen = torch.Generator().manual_seed(v)
    x, z = gdn_projection(t, hv, v, dtype, gen)
    w = norm_weight(v, gen, dtype)
    y = fused.gated_rms_norm(x, z, w, EPS)
    assert y.shape == (t, hv * v)
    close(y, fused.gated_rms_norm_ref(x, z, w, EPS))


# (T, Hq, Hkv, D, rot): 0.8B / Qwen3-Next (8, 2, 256, 64); the default model (head dim 64,
# rot 16); D = 36: the element path for 16-bit dtypes; rot = D
@pytest.mark.parametrize("t,hq,hkv,d,rot", [(2, 8, 2, 256, 64), (3, 4, 2, 64, 16),
                                             (2, 3, 1, 36, 12), (1, 2, 2, 32, 32)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_qk_norm_rope_matches_the_reference(t, hq, hkv, d, rot, dtype):
    gen = torch.Generator().manual_seed(d + rot)
    q_gate, k = attention_projection(t, hq, hkv, d, dtype, gen)
    qw, kw = norm_weight(d, gen), norm_weight(d, gen)
    cos, sin = rope(t, rot, dtype, gen)
    before = q_gate.clone()
    q, k_out = fused.qk_norm_rope(q_gate, k, qw, kw, cos, sin, EPS)
    q_ref, k_ref = fused.qk_norm_rope_ref(q_gate, k, qw, kw, cos, sin, EPS)
    close(q, q_ref)
    close(k_out, k_ref)
    assert torch.equal(q_gate, before), "the inputs (and the gate) are read only"


@pytest.mark.parametrize("t,hq,d", [(3, 8, 256), (2, 4, 64), (2, 3, 36)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_sigmoid_gate_mul_reads_the_gate_in_place(t, hq, d, dtype):
    gen = torch.Generator().manual_seed(d)
    q_gate, _ = attention_projection(t, hq, 2, d, dtype, gen)
    o = torch.randn(t, hq, d, generator=gen).to(dtype)
    close(fused.sigmoid_gate_mul(o, q_gate), fused.sigmoid_gate_mul_ref(o, q_gate))


# I = 3584: the 0.8B MLP; 37: the element path; 2000: more columns than one block of threads
@pytest.mark.parametrize("t,i", [(2, 3584), (3, 37), (2, 2000)])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_emulated_silu_mul_matches_the_reference(t, i, layout, dtype):
    gen = torch.Generator().manual_seed(i)
    gate_up = rows(t, 2 * i, dtype, layout, gen, scale=3.0)
    close(fused.silu_mul(gate_up), fused.silu_mul_ref(gate_up))
