"""The training-time chunked gated delta rule against transformers' own torch implementation."""

from __future__ import annotations

import pytest
import torch
from transformers.models.qwen3_5 import modeling_qwen3_5

from deltaserve.default_model.gdn_chunked import (
    causal_conv1d_shift,
    chunk_gated_delta_rule_torch,
    unit_lower_inverse,
)

# both compute in fp32 (as fla does), so they agree to fp32 rounding.
# transformers binds fla's kernel at import when fla is installed; the torch original stays
# reachable as __wrapped__
_bound = modeling_qwen3_5.torch_chunk_gated_delta_rule
ORACLE = getattr(_bound, "__wrapped__", _bound)


def _inputs(seq: int, h: int, hv: int, dk: int, dv: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    bsz = 2
    q = torch.randn(bsz, seq, h, dk, generator=gen)
    k = torch.randn(bsz, seq, h, dk, generator=gen)
    v = torch.randn(bsz, seq, hv, dv, generator=gen)
    g = -torch.rand(bsz, seq, hv, generator=gen) * 0.5  # decays exp(g) in (0.6, 1]
    beta = torch.rand(bsz, seq, hv, generator=gen)
    state = torch.randn(bsz, hv, dk, dv, generator=gen)
    return [x.requires_grad_() for x in (q, k, v, g, beta, state)]


@pytest.mark.parametrize("solve", ["trsm", "blocked"])
@pytest.mark.parametrize("seq,chunk", [(1, 64), (64, 64), (150, 64), (100, 32)])
@pytest.mark.parametrize("h,hv", [(2, 2), (2, 4)])
def test_outputs_final_state_and_gradients_match_transformers_torch_rule(seq, chunk, h, hv,
                                                                           solve):
    dk, dv = 16, 8
    xs = _inputs(seq, h, hv, dk, dv, seed=seq + hv)
    results = []
    for fn in (chunk_gated_delta_rule_torch, ORACLE):
        q, k, v, g, beta, state = xs
        extra = {"solve": solve} if fn is chunk_gated_delta_rule_torch else {}
        out, final = fn(q, k, v, g, beta, chunk_size=chunk, initial_state=state,
                        output_final_state=True, use_qk_l2norm_in_kernel=True, **extra)
        grads = torch.autograd.grad((out * out).sum() + final.sum(), xs)
        results.append((out, final, grads))
    (out, final, grads), (ref_out, ref_final, ref_grads) = results
    assert out.shape == ref_out.shape and out.dtype == ref_out.dtype
    torch.testing.assert_close(out, ref_out, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(final, ref_final.to(final.dtype), rtol=2e-5, atol=2e-5)
    for name, got, want in zip("q k v g beta state".split(), grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4, msg=f"d/d{name}")


def test_no_initial_state_is_a_zero_state_and_no_final_state_is_returned_unless_asked():
    q, k, v, g, beta, state = (x.detach() for x in _inputs(70, 2, 2, 16, 8, seed=3))
    out, final = chunk_gated_delta_rule_torch(q, k, v, g, beta)
    zero_out, _ = chunk_gated_delta_rule_torch(q, k, v, g, beta,
                                               initial_state=torch.zeros_like(state))
    assert final is None
    torch.testing.assert_close(out, zero_out, rtol=0, atol=0)
    ref_out, _ = ORACLE(q, k, v, g, beta)
    # without the L2 norm outputs reach ~5, so the fp32 rounding is larger
    torch.testing.assert_close(out, ref_out.to(out.dtype), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("size", [1, 8, 16, 32, 64, 128])
def test_unit_lower_inverse_is_the_inverse_and_refuses_sizes_it_cannot_split(size):
    gen = torch.Generator().manual_seed(size)
    a = (torch.randn(3, 2, size, size, generator=gen, dtype=torch.float64) * 0.3).tril(-1)
    want = torch.linalg.inv(torch.eye(size, dtype=a.dtype) + a)
    torch.testing.assert_close(unit_lower_inverse(a), want, rtol=1e-9, atol=1e-9)
    with pytest.raises(ValueError, match="power of two"):
        unit_lower_inverse(torch.zeros(48, 48))
    with pytest.raises(ValueError, match="solve must be"):
        chunk_gated_delta_rule_torch(*(x.detach() for x in _inputs(4, 1, 1, 4, 4, 0)[:5]),
                                     solve="lu")


@pytest.mark.parametrize("bias,activation", [(False, "silu"), (True, None)])
def test_causal_conv1d_shift_matches_the_depthwise_conv_fallback_with_gradients(bias, activation):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(2, 6, 11, generator=gen, requires_grad=True)
    w = torch.randn(6, 4, generator=gen, requires_grad=True)
    b = torch.randn(6, generator=gen, requires_grad=True) if bias else None
    fallback = getattr(modeling_qwen3_5.causal_conv1d_fn, "__wrapped__",
                       modeling_qwen3_5.causal_conv1d_fn)
    outs = [fn(x, w, b, activation=activation) for fn in (causal_conv1d_shift, fallback)]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    params = [p for p in (x, w, b) if p is not None]
    grads = [torch.autograd.grad(o.square().sum(), params) for o in outs]
    for got, want in zip(*grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_shift(x, w, activation="gelu")


def test_causal_conv_override_reaches_the_layers_and_is_undone():
    from deltaserve.default_model.config import default_text_config
    from deltaserve.default_model.hf_reference import causal_conv_override, torch_gdn_reference

    tiny = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
            "linear_num_key_heads": 2, "linear_num_value_heads": 4,
            "linear_key_head_dim": 16, "linear_value_head_dim": 16}
    torch.manual_seed(0)
    model = modeling_qwen3_5.Qwen3_5ForCausalLM(default_text_config(**tiny)).eval()
    ids = torch.randint(0, 8000, (1, 20))
    calls = []

    def counting(x, weight, bias=None, activation=None, **kw):
        calls.append(x.shape)
        return causal_conv1d_shift(x, weight, bias, activation)

    before = modeling_qwen3_5.causal_conv1d_fn
    with torch.no_grad(), torch_gdn_reference():
        want = model(ids).logits
        with causal_conv_override(counting, model):
            got = model(ids).logits
        again = model(ids).logits
    assert len(calls) == 3  # the three GDN layers of four
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert modeling_qwen3_5.causal_conv1d_fn is before and torch.equal(again, want)


def test_unit_lower_inverse_gradient_is_that_of_the_inverse():
    gen = torch.Generator().manual_seed(5)
    a = (torch.randn(2, 32, 32, generator=gen, dtype=torch.float64) * 0.2).tril(-1)
    a.requires_grad_()
    g = torch.randn(2, 32, 32, generator=gen, dtype=torch.float64)
    (got,) = torch.autograd.grad((unit_lower_inverse(a) * g).sum(), a)
    (want,) = torch.autograd.grad((torch.linalg.inv(torch.eye(32, dtype=a.dtype) + a) * g).sum(), a)
    torch.testing.assert_close(got, want.tril(-1), rtol=1e-10, atol=1e-10)
