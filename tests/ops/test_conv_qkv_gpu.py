"""gdn_conv_prefill on CUDA (conv_qkv_prefill's kernel path): the q | k | v blocks bit for bit
the plain prefill kernel's output for v, q and k its L2 norm per head, windows as the plain
kernel writes them; fresh random inputs, every kernel dtype, the models' shapes."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import causal_conv1d_prefill
from deltaserve.ops._ext import extension_loaded
from deltaserve.ops.conv1d import conv_qkv_prefill
from deltaserve.ops.gdn import _l2norm

pytestmark = pytest.mark.gpu
DEV, W = "cuda", 4


@pytest.fixture(autouse=True)
def _extension_is_built():
    assert extension_loaded(), "deltaserve._C is not built: the GPU tests would test nothing"


@pytest.mark.parametrize(("h", "k", "hv", "v"), [(16, 128, 16, 128),  # 0.8B config
                                                 (16, 128, 32, 128),  # Qwen3-Next
                                                 (4, 32, 8, 32),  # the default model
                                                 (2, 64, 6, 64)])
@pytest.mark.parametrize("lengths", [[256], [1, 2, 0, 70, 5], [8192], [33] * 9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_qkv_prefill_is_the_plain_kernels_conv_with_q_and_k_normalised(h, k, hv, v, lengths,
                                                                       dtype):
    d, n = 2 * h * k + hv * v, len(lengths)
    gen = torch.Generator(device=DEV).manual_seed(sum(lengths) + d)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen, device=DEV) * s).to(dtype)

    weight, bias, state = rnd(d, W, s=0.5), rnd(d, s=0.1), rnd(2 * n + 2, W - 1, d)
    x = rnd(sum(lengths), d)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32,
                      device=DEV)
    slots = torch.arange(1, n + 1, dtype=torch.int32, device=DEV).flip(0)
    offsets = torch.tensor([ln // 2 for ln in lengths], dtype=torch.int32, device=DEV)
    track = torch.arange(n + 1, 2 * n + 1, dtype=torch.int32, device=DEV)
    track[::2] = 0
    plain = state.clone()
    y = causal_conv1d_prefill(x, weight, bias, plain, cu, slots, offsets, track)
    q, kk, vv = conv_qkv_prefill(x, weight, bias, state, cu, slots, offsets, track,
                                 num_k_heads=h, head_k_dim=k)
    t = x.shape[0]
    assert torch.equal(state, plain)
    assert q.is_contiguous() and kk.is_contiguous() and vv.is_contiguous()
    assert torch.equal(vv, y[:, 2 * h * k:])
    # rsqrt and the fp32 sum order: within one unit in the last place of a 16-bit output
    tol = dict(atol=1e-6, rtol=2e-6) if dtype == torch.float32 else dict(atol=4e-3, rtol=8e-3)
    for got, part in ((q, y[:, :h * k]), (kk, y[:, h * k:2 * h * k])):
        want = _l2norm(part.reshape(t, h, k)).to(dtype)
        torch.testing.assert_close(got.float(), want.float(), **tol)
