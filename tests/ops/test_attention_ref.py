"""The pure-torch paged attention and KV append (the CPU path and the GPU oracle) against the
dense per-request definition, and their argument checks."""

from __future__ import annotations

import pytest
import torch
from attention_helpers import dense_attention, paged_case

from deltaserve.ops.attention import kv_append, paged_attention


@pytest.mark.parametrize("rows,hq,hkv,page_size", [(1, 4, 1, 16), (4, 8, 2, 1), (3, 2, 2, 5)])
def test_reference_matches_the_dense_definition(rows, hq, hkv, page_size):
    lens = [rows, 17, 40, 0, 33]
    q, kc, vc, table, kv_lens = paged_case(lens, rows, hq, hkv, 16, page_size, torch.float32)
    got = paged_attention(q, kc, vc, table, kv_lens, 0.3, 64)
    want = dense_attention(q, kc, vc, table, kv_lens, 0.3)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_kv_append_writes_each_row_at_its_position_and_nothing_else():
    rows, page_size = 3, 4
    q, kc, vc, table, kv_lens = paged_case([5, 12, 0], rows, 2, 2, 8, page_size, torch.float32)
    k, v = torch.randn(9, 2, 8), torch.randn(9, 2, 8)
    k_before, v_before = kc.clone(), vc.clone()
    kv_append(k, v, kc, vc, table, kv_lens)
    want_k, want_v = k_before.clone(), v_before.clone()
    for i in range(3):
        for r in range(rows):
            p = int(kv_lens[i]) - rows + r
            page = int(table[i, p // page_size])
            want_k[page, p % page_size] = k[i * rows + r]
            want_v[page, p % page_size] = v[i * rows + r]
    assert torch.equal(kc, want_k) and torch.equal(vc, want_v)


def test_bad_arguments_raise_naming_them():
    q, kc, vc, table, kv_lens = paged_case([8, 9], 1, 4, 2, 16, 4, torch.float32)
    with pytest.raises(ValueError, match="int32"):
        paged_attention(q, kc, vc, table.long(), kv_lens, 1.0, 16)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        paged_attention(q[:, :, :3], kc, vc, table, kv_lens, 1.0, 16)
    with pytest.raises(ValueError, match="kv_lens must lie"):
        paged_attention(q, kc, vc, table, kv_lens * 10, 1.0, 16)
    with pytest.raises(ValueError, match="page_table must lie"):
        paged_attention(q, kc, vc, table + kc.shape[0], kv_lens, 1.0, 16)
    with pytest.raises(ValueError, match=r"k must be \[N \* R"):
        kv_append(torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), kc, vc, table, kv_lens)
