"""The paged attention and KV append kernels' own code on the CPU (kernels_emu.py) against the
pure-torch references: one and several splits per request (the merge), split edges inside a
page and on page boundaries +-1, causal verify rows, GQA 1/4/8, D 64/128/256, heads split over
blocks (8 heads x 4 rows), padding requests on page 0. bf16 inputs; fp32 accumulation on both
sides, so the outputs agree to a few bf16 ulps."""

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


def test_kv_append_kernel_equals_the_reference_bit_for_bit():
    q, kc, vc, table, kv_lens = paged_case([9, 16, 0], 2, 4, 2, 128, 8, torch.bfloat16)
    k = torch.randn(6, 2, 128).bfloat16()
    v = torch.randn(6, 2, 128).bfloat16()
    want_k, want_v = kc.clone(), vc.clone()
    kv_append_ref(k, v, want_k, want_v, table, kv_lens)
    kv_append(k, v, kc, vc, table, kv_lens)
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)
