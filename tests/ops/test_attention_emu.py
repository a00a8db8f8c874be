"""The paged attention and KV append kernels' own code on the CPU (kernels_emu.py) against the
pure-torch references: one and several splits per request (the merge), splits of one and of
many tiles, split edges inside a page and on page boundaries +-1, causal verify rows, GQA
1/3/4/8, D 64/128/256, heads split over blocks (8 heads x 4 rows), padding requests on page 0.
bf16 and fp16 inputs; fp32 accumulation on both sides (the kernel's probabilities rounded to
the input type for the P V product), so the outputs agree to a few bf16 ulps. The kernel's
MMAs run here as their portable shuffle form (compat.cuh), whose fragment layout is the PTX
ISA's: the GPU tests check the tensor-core form."""

from __future__ import annotations

import kernels_emu
import pytest
import torch
from attention_helpers import PEAK, paged_case

from deltaserve.ops.attention import (
    kv_append,
    kv_append_ref,
    paged_attention,
    paged_attention_ref,
)


@pytest.fixture(autouse=True)
def _emulated(monkeypatch):
    ops = kernels_emu.emulate(monkeypatch)
    yield
    assert ops.calls > 0, "the wrappers ran the reference, not the emulated kernels"


CASES = [  # lens (0: padding), rows, hq, hkv, d, page_size
    ([1, 33, 0], 1, 4, 1, 128, 16),
    ([31, 32, 64, 65], 1, 2, 2, 128, 1),
    ([97, 4], 4, 8, 1, 256, 7),
    ([129, 0], 4, 16, 2, 128, 128),
    ([70, 0, 5], 1, 4, 2, 64, 16),  # the default model's attention (D 64: per-element V)
    ([40, 9], 4, 4, 2, 64, 16),
]


@pytest.mark.parametrize("lens,rows,hq,hkv,d,page_size", CASES)
def test_kernel_matches_the_reference(lens, rows, hq, hkv, d, page_size):
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, d, page_size, torch.bfloat16,
                                           q_scale=PEAK)
    # max_kv_len large: the emulated device's 132 SMs give several splits even at these lengths
    got = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, 4096)
    want = paged_attention_ref(q, kc, vc, table, kv_lens, d ** -0.5, 4096)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


def test_one_split_writes_the_output_directly():
    # max_kv_len 1: a one-split grid, no merge
    q, kc, vc, table, kv_lens = paged_case([20, 3], 2, 4, 2, 128, 4, torch.bfloat16,
                                           q_scale=PEAK)
    got = paged_attention(q, kc, vc, table, kv_lens, 0.1, 1)
    want = paged_attention_ref(q, kc, vc, table, kv_lens, 0.1, 64)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


LONG_CASES = [  # lens, rows, hq, hkv, d, page_size, max_kv_len, dtype
    # one split of 10 tiles: the page-id and K/V prefetch across tiles, page size 3
    ([300, 77], 1, 4, 1, 128, 3, 1, torch.bfloat16),
    # 3 splits of 4 tiles (merged), 9 rows a block (GQA 3 x R 3), fp16
    ([300, 40], 3, 6, 2, 64, 16, 96, torch.float16),
    # GQA 8 decode: 8 rows a block; a split edge inside a page
    ([257, 96], 1, 16, 2, 256, 64, 128, torch.bfloat16),
    # 63 one-tile splits of one row: every merge thread group folds several splits
    ([2000], 1, 1, 1, 64, 16, 4096, torch.bfloat16),
    # 313 splits of 64 (528 in the grid: the emulated 132 SMs x 4 blocks at D 64): a merge
    # warp's lanes read 9-10 log-sum-exps each, a thread group folds 9-10 splits; the last
    # split holds only position 19968, which verify row 0 (it sees 0 .. 19967) does not see:
    # its lse is -inf, its weight 0
    ([19969], 2, 2, 1, 64, 32, 20000, torch.bfloat16),
]


@pytest.mark.parametrize("lens,rows,hq,hkv,d,page_size,max_kv_len,dtype", LONG_CASES)
def test_multi_tile_splits_match_the_reference(lens, rows, hq, hkv, d, page_size, max_kv_len,
                                               dtype):
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, d, page_size, dtype,
                                           q_scale=PEAK, seed=d)
    got = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, max_kv_len)
    want = paged_attention_ref(q, kc, vc, table, kv_lens, d ** -0.5, max(lens))
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


MERGE_CASES = [  # lens, rows, hq, hkv, d, page_size, max_kv_len: the grid's split count
    # (max_kv_len / 32 here) picks the merge's thread groups, each block max(4, 1024 / D) ..
    # 32 groups over 1024 / groups columns (merge_groups)
    ([128, 100], 4, 8, 2, 256, 16, 128),  # 4 splits: 4 groups over a whole 256-column row
    ([96, 0, 61], 1, 8, 2, 256, 16, 96),  # 3 splits: 4 groups; a padding request
    ([200, 33], 4, 8, 2, 256, 8, 200),  # 7 splits: 8 groups over half a row
    ([250, 33], 1, 4, 1, 128, 16, 256),  # 8 splits: 8 groups over a whole 128-column row
    ([384, 70], 2, 4, 2, 128, 16, 384),  # 12 splits: 16 groups over half a row
    ([64, 40], 4, 4, 2, 64, 16, 64),  # 2 splits at D 64: 16 groups, the fewest a row allows
]


@pytest.mark.parametrize("lens,rows,hq,hkv,d,page_size,max_kv_len", MERGE_CASES)
def test_the_merge_of_few_splits_matches_the_reference(lens, rows, hq, hkv, d, page_size,
                                                        max_kv_len):
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, d, page_size, torch.bfloat16,
                                           q_scale=PEAK, seed=max_kv_len)
    got = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, max_kv_len)
    want = paged_attention_ref(q, kc, vc, table, kv_lens, d ** -0.5, max_kv_len)
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("lens,page_size,max_kv_len", [([45, 70], 16, 4096), ([45, 70], 5, 1),
                                                     ([300, 33], 7, 128)])
def test_positions_past_a_request_are_never_read(lens, page_size, max_kv_len):
    """Every pool position outside the requests' KV (the rest of their last pages, spare
    pages, page 0) holds NaN: a split whose last tile runs past its positions reads none of
    them (it re-reads its own last position, whose P is 0), so the outputs stay finite."""
    q, kc, vc, table, kv_lens = paged_case(lens, 1, 4, 2, 64, page_size, torch.bfloat16,
                                           q_scale=PEAK, seed=5)
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for i, n in enumerate(kv_lens.tolist()):
        pos = torch.arange(n)
        used[table[i].long()[pos // page_size], pos % page_size] = True
    want = paged_attention_ref(q, kc, vc, table, kv_lens, 0.125, max(lens))
    kc[~used], vc[~used] = float("nan"), float("nan")
    got = paged_attention(q, kc, vc, table, kv_lens, 0.125, max_kv_len)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=1.6e-2)


@pytest.mark.parametrize("lens,rows,hq,hkv,d,page_size", CASES)
def test_ldmatrix_fragments_give_the_same_bits(lens, rows, hq, hkv, d, page_size, monkeypatch):
    """DS_ATTN_LDMATRIX=1: the Q, K, P and V fragments through load_matrix_x4 (here its portable
    form: the registers ldmatrix documents) give the bits of the 16-bit loads."""
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, d, page_size, torch.bfloat16,
                                           q_scale=PEAK, seed=11)
    plain = paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, 4096)
    monkeypatch.setenv("DS_ATTN_LDMATRIX", "1")
    assert torch.equal(paged_attention(q, kc, vc, table, kv_lens, d ** -0.5, 4096), plain)


def test_kv_append_kernel_equals_the_reference_bit_for_bit():
    q, kc, vc, table, kv_lens = paged_case([9, 16, 0], 2, 4, 2, 128, 8, torch.bfloat16)
    k = torch.randn(6, 2, 128).bfloat16()
    v = torch.randn(6, 2, 128).bfloat16()
    want_k, want_v = kc.clone(), vc.clone()
    kv_append_ref(k, v, want_k, want_v, table, kv_lens)
    kv_append(k, v, kc, vc, table, kv_lens)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
