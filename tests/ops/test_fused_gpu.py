"""CUDA fused norm / gate kernels against the pure-torch references (deltaserve/ops/fused.py) at
the model's shapes: the 0.8B config (hidden 1024, GDN 16 x 128 with z inside the 8224-wide
projection, attention 8 / 2 heads of 256, rot 64, intermediate 3584), the default model (hidden
256, head dim 64, rot 16, GDN 8 x 32) and Qwen3-Next (hidden 2048), T = 1 .. 8192, bf16 / fp16
/ fp32, dense, strided and misaligned views. Inputs are fresh each run (the seed is printed, so
a failure can be replayed with FUSED_SEED=<seed>).

Tolerance (fused_inputs.TOL): two ulps of a 16-bit output, 2e-5 for fp32. The kernels round
where the references round; they differ where the fp32 sum order (and the GPU's rsqrt, exp and
division, a few fp32 ulps) moves a value across a rounding boundary, which a later rounding
(gated: x̂ then w·x̂; qk: the norm then each RoPE product) can carry one more ulp. The residual
sum of add_rms_norm is bitwise."""

from __future__ import annotations

import os

import fused_inputs as inp
import pytest
import torch

from deltaserve.ops import fused
from deltaserve.ops._ext import extension_loaded

pytestmark = pytest.mark.gpu
DEV, EPS = "cuda", 1e-6
TOKENS = [1, 33, 8192]


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


@pytest.fixture
def gen() -> torch.Generator:
    seed = int(os.environ.get("FUSED_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"FUSED_SEED={seed}")
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("d", [1024, 256, 2048, 1000])
@pytest.mark.parametrize("layout", inp.LAYOUTS)
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_rms_norm_matches_the_reference(t, d, layout, dtype, gen):
    x = inp.rows(t, d, dtype, layout, gen, DEV, scale=3.0)
    w = inp.norm_weight(d, gen, device=DEV)
    inp.close(fused.rms_norm(x, w, EPS), fused.rms_norm_ref(x, w, EPS))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("d", [1024, 256, 2048])
@pytest.mark.parametrize("layout", inp.LAYOUTS)
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_add_rms_norm_sum_is_bitwise_and_norm_matches(t, d, layout, dtype, gen):
    x = inp.rows(t, d, dtype, layout, gen, DEV)
    residual = inp.rows(t, d, dtype, "strided", gen, DEV, scale=4.0)
    w = inp.norm_weight(d, gen, device=DEV)
    y, s = fused.add_rms_norm(x, residual, w, EPS)
    y_ref, s_ref = fused.add_rms_norm_ref(x, residual, w, EPS)
    assert torch.equal(s, s_ref)
    inp.close(y, y_ref)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hv,v", [(16, 128), (8, 32), (3, 36)])
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_gated_rms_norm_over_the_projection_view_matches(t, hv, v, dtype, gen):
    x, z = inp.gdn_projection(t, hv, v, dtype, gen, DEV)
    w = inp.norm_weight(v, gen, dtype, DEV)
    # both round at three points (x̂, w * x̂, the output): a one-ulp move of x̂ from the fp32
    # sum order is carried, and re-rounded, through the next two, so over 16 M outputs
    # (T=8192) one in millions lands 3-3.5 ulps off (bf16 and fp16 on the H200, 2026-12-03):
    # 4 ulps here, 2 for the ops with fewer rounding points
    inp.close(fused.gated_rms_norm(x, z, w, EPS), fused.gated_rms_norm_ref(x, z, w, EPS),
              scale=2.0)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hq,hkv,d,rot", [(8, 2, 256, 64), (16, 2, 256, 64), (4, 2, 64, 16),
                                           (3, 1, 36, 12)])
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_qk_norm_rope_matches_the_reference(t, hq, hkv, d, rot, dtype, gen):
    q_gate, k = inp.attention_projection(t, hq, hkv, d, dtype, gen, DEV)
    qw, kw = inp.norm_weight(d, gen, device=DEV), inp.norm_weight(d, gen, device=DEV)
    cos, sin = inp.rope(t, rot, dtype, gen, DEV)
    q, k_out = fused.qk_norm_rope(q_gate, k, qw, kw, cos, sin, EPS)
    q_ref, k_ref = fused.qk_norm_rope_ref(q_gate, k, qw, kw, cos, sin, EPS)
    # the rotation mixes two normalised values: where one of them sits an ulp apart, the output
    # can move two of its ulps (seen once in 16.7 M fp16 outputs at T = 8192 on the H200)
    inp.close(q, q_ref, scale=2.0)
    inp.close(k_out, k_ref, scale=2.0)


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("hq,d", [(8, 256), (4, 64), (3, 36)])
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_sigmoid_gate_mul_matches_the_reference(t, hq, d, dtype, gen):
    q_gate, _ = inp.attention_projection(t, hq, 2, d, dtype, gen, DEV)
    o = torch.randn(t, hq, d, generator=gen).to(dtype).to(DEV)
    inp.close(fused.sigmoid_gate_mul(o, q_gate), fused.sigmoid_gate_mul_ref(o, q_gate))


@pytest.mark.parametrize("t", TOKENS)
@pytest.mark.parametrize("i", [3584, 37, 512])
@pytest.mark.parametrize("layout", inp.LAYOUTS)
@pytest.mark.parametrize("dtype", inp.DTYPES)
def test_silu_mul_matches_the_reference(t, i, layout, dtype, gen):
    gate_up = inp.rows(t, 2 * i, dtype, layout, gen, DEV, scale=3.0)
    inp.close(fused.silu_mul(gate_up), fused.silu_mul_ref(gate_up))


def _all_ops(t: int, gen: torch.Generator):
    """Closures calling every fused op once on 0.8B-shaped bf16 inputs, and their inputs."""
    dt = torch.bfloat16
    x = inp.rows(t, 1024, dt, "dense", gen, DEV)
    res = inp.rows(t, 1024, dt, "dense", gen, DEV)
    w = inp.norm_weight(1024, gen, device=DEV)
    gx, z = inp.gdn_projection(t, 16, 128, dt, gen, DEV)
    gw = inp.norm_weight(128, gen, dt, DEV)
    q_gate, k = inp.attention_projection(t, 8, 2, 256, dt, gen, DEV)
    qw = inp.norm_weight(256, gen, device=DEV)
    cos, sin = inp.rope(t, 64, dt, gen, DEV)
    o = torch.randn(t, 8, 256, generator=gen).to(dt).to(DEV)
    gate_up = inp.rows(t, 7168, dt, "dense", gen, DEV)
    calls = [lambda: fused.rms_norm(x, w, EPS), lambda: fused.add_rms_norm(x, res, w, EPS),
             lambda: fused.gated_rms_norm(gx, z, gw, EPS),
             lambda: fused.qk_norm_rope(q_gate, k, qw, qw, cos, sin, EPS),
             lambda: fused.sigmoid_gate_mul(o, q_gate), lambda: fused.silu_mul(gate_up)]
    return calls, [x, res, gx, z, q_gate, o, gate_up]


def test_no_op_synchronises_the_host(gen):
    calls, _ = _all_ops(4, gen)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for call in calls:
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_every_op_replays_in_a_cuda_graph_on_new_inputs(gen):
    calls, inputs = _all_ops(1, gen)
    for call in calls:  # warm-up outside capture
        call()
    torch.cuda.synchronize()
    graph, outs = torch.cuda.CUDAGraph(), []
    with torch.cuda.graph(graph):
        outs = [call() for call in calls]
    for t in inputs:
        t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
    graph.replay()
    torch.cuda.synchronize()
    for got, expect in zip(outs, [call() for call in calls]):
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        expect if isinstance(expect, tuple) else (expect,)):
            assert torch.equal(a, b), "a replay must compute what an eager call computes"
