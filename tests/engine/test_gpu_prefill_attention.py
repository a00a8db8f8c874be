"""Prefill attention on CUDA (bf16, the 0.8B config's heads): the per-request path (flash, no
mask), the varlen path (flash's variable-length forward) and the padded path against the dense
definition, and no host sync in a call."""

from __future__ import annotations

import pytest
import torch
from test_prefill_attention import PATHS, case, dense

from deltaserve.engine.prefill_attention import AttentionMetadata, prefill_attention

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")


def on_gpu(k_cache, v_cache, tables, q, k, v):
    return (k_cache.to(DEV, torch.bfloat16), v_cache.to(DEV, torch.bfloat16), tables,
            q.to(DEV, torch.bfloat16), k.to(DEV, torch.bfloat16), v.to(DEV, torch.bfloat16))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("starts", "lens"), [
    ([0], [256]),  # a cold prompt: is_causal over its own rows
    ([8128], [64]),  # the tail of an 8k prompt: bottom-right causal over gathered pages
    ([4096], [300]),  # a follow-up turn: grouped kv heads (enable_gqa), bottom-right causal
    ([0, 300, 5], [200, 77, 1]),
    ([0], [2048]),
    ([0, 1000, 17, 0, 333, 64], [100, 300, 1, 64, 5, 129]),  # past PER_REQUEST_MAX: varlen
])
def test_every_path_matches_the_dense_definition_in_bf16(path, starts, lens):
    from deltaserve.engine import prefill_attention as pa

    kc, vc, tables, qg, kg, vg = on_gpu(*case(starts, lens, 16, hq=8, hkv=2, d=256, seed=1))
    # the definition reads the same bf16 values
    want = dense(kc.cpu().float(), vc.cpu().float(), tables, starts, lens, qg.cpu().float(),
                 kg.cpu().float(), vg.cpu().float())
    meta = AttentionMetadata.build(tables, starts, lens, 16, DEV, **PATHS[path])
    got = prefill_attention(meta, kc, vc, qg, kg, vg)
    assert not pa._varlen_failed  # the flash call ran (no fallback)
    assert got.is_contiguous() and got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)


def test_cuda_picks_the_per_request_path_up_to_its_limit():
    from deltaserve.engine.prefill_attention import PER_REQUEST_MAX

    n = PER_REQUEST_MAX
    tables = [[i + 1] for i in range(n + 1)]
    assert AttentionMetadata.build(tables[:n], [0] * n, [4] * n, 16, DEV).per_request
    assert not AttentionMetadata.build(tables, [0] * (n + 1), [4] * (n + 1), 16, DEV).per_request


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])  # 5 requests: padded, varlen
@pytest.mark.parametrize("starts", [[0], [100], [0, 64, 3, 9, 11]])
def test_a_prefill_attention_call_never_waits_for_the_device(starts, dtype):
    lens = [128] * len(starts)
    kc, vc, tables, q, k, v = on_gpu(*case(starts, lens, 16, hq=8, hkv=2, d=256, seed=2))
    meta = AttentionMetadata.build(tables, starts, lens, 16, DEV, dtype=dtype)
    assert meta.varlen == (dtype is not None and len(starts) > 4)
    prefill_attention(meta, kc, vc, q, k, v)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        prefill_attention(meta, kc, vc, q, k, v)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


@pytest.mark.parametrize("path", PATHS)
def test_no_call_goes_to_cudnn_which_plans_every_new_shape(path):
    """cuDNN's SDPA builds an execution plan per unseen shape (prefill_attention's docstring):
    the kernels that run are flash or memory-efficient attention, at any length."""
    from torch.profiler import ProfilerActivity, profile

    starts, lens = [0, 300], [137, 61]
    kc, vc, tables, q, k, v = on_gpu(*case(starts, lens, 16, hq=8, hkv=2, d=256, seed=3))
    meta = AttentionMetadata.build(tables, starts, lens, 16, DEV, **PATHS[path])
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_attention(meta, kc, vc, q, k, v)
        torch.cuda.synchronize()
    names = [e.key for e in prof.key_averages()]
    assert any("attention" in n.lower() for n in names)  # the probe sees SDPA at all
    assert not any("cudnn" in n.lower() for n in names), names
