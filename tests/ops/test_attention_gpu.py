"""CUDA paged attention and KV append against the pure-torch references: page sizes 1, 16,
64, 128; context lengths 1 .. 40k with page boundaries +-1; GQA 1/4/8; head dims 64/128/256;
decode (R = 1) and verify (R = 4); padding requests (page 0, kv_len = R); eager and inside a
CUDA graph whose lengths change between replays."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import PEAK, paged_case

from deltaserve.ops._ext import extension_loaded
from deltaserve.ops.attention import (
    kv_append,
    kv_append_ref,
    paged_attention,
    paged_attention_ref,
)

pytestmark = pytest.mark.gpu
DEV = "cuda"
MAX_LEN = 40_960


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


def _lens(page_size: int, rows: int) -> list[int]:
    """Short, on and around page boundaries, across split sizes, up to 40k; 0 = padding."""
    edges = [page_size * k + e for k in (1, 2, 33) for e in (-1, 0, 1)]
    return [max(rows, n) for n in [1, 2, 31, 32, 33, 127, 129, 2047, 8193, 32_768, 40_000]
            + edges] + [0]


def _check(q, kc, vc, table, kv_lens, max_len=MAX_LEN):
    d = q.shape[-1]
    got = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, max_len)
    want = paged_attention_ref(q, kc, vc, table, kv_lens, d ** -0.5, max_len)
    # bf16 output of an fp32 computation on both sides (peaked softmax: outputs O(1) at every
    # length, so a position or split left out is far outside this): a few bf16 ulps
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("page_size", [1, 16, 64, 128])
@pytest.mark.parametrize("rows", [1, 4])
def test_decode_and_verify_match_the_reference_at_every_length(page_size, rows):
    q, kc, vc, table, kv_lens = paged_case(_lens(page_size, rows), rows, 8, 2, 256, page_size,
                                           torch.bfloat16, DEV, seed=page_size, q_scale=PEAK)
    _check(q, kc, vc, table, kv_lens)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (16, 2)])  # GQA 1, 4, 8
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_ratios_head_dims_and_dtypes(hq, hkv, d, rows, dtype):
    lens = [rows, 100, 1025, 5000, 0, 17_000]
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, d, 16, dtype, DEV, seed=d,
                                           q_scale=PEAK)
    _check(q, kc, vc, table, kv_lens)


@pytest.mark.parametrize("batch", [1, 8, 32, 128])
def test_batch_sizes_change_the_split_plan_not_the_answer(batch):
    lens = [(i * 997) % 9000 + 1 for i in range(batch)]
    q, kc, vc, table, kv_lens = paged_case(lens, 1, 8, 2, 256, 16, torch.bfloat16, DEV,
                                           q_scale=PEAK)
    _check(q, kc, vc, table, kv_lens, max_len=9001)


@pytest.mark.parametrize("d,max_len", [(256, 96), (256, 200), (128, 256), (128, 384), (64, 64)])
@pytest.mark.parametrize("rows", [1, 4])
def test_few_splits_merge_in_wider_blocks(d, max_len, rows):
    """max_len / 32 splits (3 .. 12): the merge's 4, 8 or 16 thread groups (merge_groups)."""
    q, kc, vc, table, kv_lens = paged_case([max_len, 33, 0], rows, 8, 2, d, 16, torch.bfloat16,
                                           DEV, seed=max_len, q_scale=PEAK)
    _check(q, kc, vc, table, kv_lens, max_len=max_len)


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("rows", [1, 4])
def test_ldmatrix_fragments_give_the_same_bits(d, rows, monkeypatch):
    """DS_ATTN_LDMATRIX=1 (the fragments through ldmatrix) loads the same registers as the
    16-bit loads, so every output bit is the same."""
    q, kc, vc, table, kv_lens = paged_case(_lens(16, rows)[:12], rows, 8, 2, d, 16,
                                           torch.bfloat16, DEV, seed=d + rows, q_scale=PEAK)
    plain = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, MAX_LEN)
    monkeypatch.setenv("DS_ATTN_LDMATRIX", "1")
    assert torch.equal(paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, MAX_LEN), plain)


def test_one_graph_serves_every_length():
    rows, page_size = 4, 16
    q, kc, vc, table, kv_lens = paged_case([MAX_LEN - 8] * 4, rows, 8, 2, 256, page_size,
                                           torch.bfloat16, DEV, q_scale=PEAK)
    static_lens = kv_lens.clone()
    out = paged_attention(q, kc, vc, table, static_lens, 256 ** -0.5, MAX_LEN)  # warm-up
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(q, kc, vc, table, static_lens, 256 ** -0.5, MAX_LEN)
    for lens in ([4, 4, 4, 4], [5, 300, 4096, 40_000], [17, 16, 15, 8193]):
        static_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        want = paged_attention_ref(q, kc, vc, table, static_lens, 256 ** -0.5, MAX_LEN)
        torch.testing.assert_close(out.float(), want.float(), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_kv_append_equals_the_reference_bit_for_bit(page_size):
    rows = 4
    q, kc, vc, table, kv_lens = paged_case([4, 77, 0, 129, 1000], rows, 8, 2, 256, page_size,
                                           torch.bfloat16, DEV, q_scale=PEAK)
    k = torch.randn(5 * rows, 2, 256, device=DEV).bfloat16()
    v = torch.randn(5 * rows, 2, 256, device=DEV).bfloat16()
    want_k, want_v = kc.clone(), vc.clone()
    kv_append_ref(k, v, want_k, want_v, table, kv_lens)
    kv_append(k, v, kc, vc, table, kv_lens)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
