"""The extension's op schemas and Meta (fake) implementations, checked on CPU with meta tensors
(what torch.compile and graph tracing see)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops._ext import extension_loaded

pytestmark = pytest.mark.skipif(not extension_loaded(), reason="deltaserve._C is not built")


def meta(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="meta", dtype=dtype)


def test_gdn_ops_report_output_shapes_and_dtypes_on_meta_tensors():
    f32, i32 = torch.float32, torch.int32
    n, r, h, hv, k = 3, 4, 2, 4, 64
    ops = torch.ops.deltaserve
    o = ops.gdn_decode(meta(n, h, k), meta(n, h, k), meta(n, hv, k), meta(n, hv), meta(n, hv),
                       meta(hv, dtype=f32), meta(hv, dtype=f32), meta(9, hv, k, k, dtype=f32),
                       meta(n, dtype=i32), 0.125)
    assert o.shape == (n, hv, k) and o.dtype == torch.bfloat16 and o.is_meta
    stash = [meta(2, n, r, h, k, dtype=f32), meta(2, n, r, hv, k, dtype=f32),
             meta(2, n, r, hv, dtype=f32), meta(2, n, r, hv, dtype=f32)]
    o = ops.gdn_verify(meta(n, r, h, k), meta(n, r, h, k), meta(n, r, hv, k), meta(n, r, hv),
                       meta(n, r, hv), meta(hv, dtype=f32), meta(hv, dtype=f32),
                       meta(9, hv, k, k, dtype=f32), meta(n, dtype=i32), 0.125, *stash, 1)
    assert o.shape == (n, r, hv, k)
    o = ops.gdn_replay_verify(meta(n, r, h, k), meta(n, r, h, k), meta(n, r, hv, k),
                              meta(n, r, hv), meta(n, r, hv), meta(hv, dtype=f32),
                              meta(hv, dtype=f32), meta(9, hv, k, k, dtype=f32),
                              meta(n, dtype=i32), 0.125, *stash, 1, *stash, meta(n, dtype=i32))
    assert o.shape == (n, r, hv, k) and o.dtype == torch.bfloat16
    ops.gdn_replay(*stash, meta(2, 9, hv, k, k, dtype=f32), meta(n, dtype=i32),
                   meta(n, dtype=i32))


def test_conv_and_snapshot_ops_accept_meta_tensors():
    ops, i32 = torch.ops.deltaserve, torch.int32
    y = ops.causal_conv1d_prefill(meta(10, 64), meta(64, 4), None, meta(5, 3, 64),
                                  meta(3, dtype=i32), meta(2, dtype=i32), None, None)
    assert y.shape == (10, 64)
    assert ops.causal_conv1d_update(meta(2, 64), meta(64, 4), meta(64), meta(5, 3, 64),
                                    meta(2, dtype=i32)).shape == (2, 64)
    assert ops.causal_conv1d_verify(meta(2, 3, 64), meta(64, 4), None, meta(5, 3, 64),
                                    meta(2, dtype=i32)).shape == (2, 3, 64)
    ops.causal_conv1d_commit(meta(2, 3, 64), meta(5, 3, 64), meta(2, dtype=i32),
                             meta(2, dtype=i32))
    ops.snapshot_copy(meta(2, 5, 8), meta(2, 5, 8), [1], [2])


def test_fused_ops_report_output_shapes_and_dtypes_on_meta_tensors():
    ops, f32 = torch.ops.deltaserve, torch.float32
    t, d = 3, 64
    assert ops.rms_norm(meta(t, 2, d), meta(d, dtype=f32), 1e-6).shape == (t, 2, d)
    y, s = ops.add_rms_norm(meta(t, d), meta(t, d), meta(d, dtype=f32), 1e-6)
    assert y.shape == s.shape == (t, d) and y.dtype == torch.bfloat16
    assert ops.gated_rms_norm(meta(t, 4, 32), meta(t, 4, 32), meta(32), 1e-6).shape == (t, 128)
    q, k = ops.qk_norm_rope(meta(t, 4, 2 * d), meta(t, 2, d), meta(d, dtype=f32),
                            meta(d, dtype=f32), meta(t, 16), meta(t, 16), 1e-6)
    assert q.shape == (t, 4, d) and k.shape == (t, 2, d) and q.is_meta
    assert ops.sigmoid_gate_mul(meta(t, 4, d), meta(t, 4, 2 * d)).shape == (t, 4 * d)
    assert ops.silu_mul(meta(t, 2 * d)).shape == (t, d)


def test_attention_ops_report_output_shapes_and_dtypes_on_meta_tensors():
    i32 = torch.int32
    n, r, hq, hkv, d = 3, 4, 8, 2, 256
    ops = torch.ops.deltaserve
    cache = meta(10, 16, hkv, d)
    o = ops.paged_attention(meta(n, r, hq, d), cache, cache, meta(n, 5, dtype=i32),
                            meta(n, dtype=i32), 0.0625, 80)
    assert o.shape == (n, r, hq, d) and o.dtype == torch.bfloat16 and o.is_meta
    ops.kv_append(meta(n * r, hkv, d), meta(n * r, hkv, d), cache, cache, meta(n, 5, dtype=i32),
                  meta(n, dtype=i32))


def test_gemv_reports_its_output_shape_and_dtype_on_meta_tensors():
    ops = torch.ops.deltaserve
    y = ops.gemv(meta(3, 64, dtype=torch.float16), meta(40, 64, dtype=torch.float16), None)
    assert y.shape == (3, 40) and y.dtype == torch.float16 and y.is_meta
    assert ops.gemv(meta(1, 64), meta(40, 64), meta(40)).shape == (1, 40)


def test_moe_ops_report_output_shapes_and_dtypes_on_meta_tensors():
    ops, f32, i32 = torch.ops.deltaserve, torch.float32, torch.int32
    t, e, k, h = 5, 16, 4, 64
    route = ops.moe_route(meta(t, e + 1), e, k, True, True, h)
    assert [tuple(r.shape) for r in route] == [(t, k), (t, k), (t, k), (t * k,),
                                               (1 + e + 1, 4), (2,), (t,), (t * 2,)]
    assert route[0].dtype == f32 and route[4].dtype == i32 and route[0].is_meta
    y = ops.moe_experts(meta(t, h), meta(e, 64, h), meta(e, h, 32), meta(48, h), meta(h, 24),
                        *(route[i] for i in (0, 2, 3, 4, 5, 6, 7)))
    assert y.shape == (t, h) and y.dtype == torch.bfloat16 and y.is_meta
