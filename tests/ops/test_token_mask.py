"""The token-bitmask op equals xgrammar's own CPU kernel, and leaves other rows alone."""

from __future__ import annotations

import pytest
import torch
import xgrammar as xgr

from deltaserve.ops.token_mask import apply_token_bitmask


@pytest.mark.parametrize("vocab", [31, 32, 100, 8192])
def test_the_mask_equals_xgrammars_kernel(vocab):
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=gen)
    bitmask = torch.randint(-2**31, 2**31 - 1, (5, (vocab + 31) // 32), generator=gen,
                            dtype=torch.int64).to(torch.int32)
    ours, ref = logits.clone(), logits.clone()
    apply_token_bitmask(ours, bitmask, [0, 2, 3])
    xgr.apply_token_bitmask_inplace(ref, bitmask, indices=[0, 2, 3], backend="cpu")
    assert torch.equal(ours, ref)
    assert torch.equal(ours[[1, 4]], logits[[1, 4]])


def test_mismatched_rows_are_a_value_error():
    with pytest.raises(ValueError, match="share M"):
        apply_token_bitmask(torch.zeros(2, 8), torch.zeros(3, 1, dtype=torch.int32), [0])


@pytest.mark.gpu
def test_the_mask_on_cuda_equals_the_cpu_result():
    logits = torch.randn(4, 1000)
    bitmask = torch.randint(0, 2**31 - 1, (4, 32), dtype=torch.int32)
    cpu, gpu = logits.clone(), logits.cuda()
    apply_token_bitmask(cpu, bitmask, [1, 3])
    apply_token_bitmask(gpu, bitmask, [1, 3])
    assert torch.equal(gpu.cpu(), cpu)
