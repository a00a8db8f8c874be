"""The fused ops' wrappers refuse arguments outside their contracts with a ValueError naming
the argument (on every path, before any kernel runs), and run the reference, right, for
inputs the kernels do not cover."""

from __future__ import annotations

import kernels_emu
import pytest
import torch
from fused_inputs import attention_projection, close, norm_weight, rope, rows

from deltaserve.ops import fused

BF16 = torch.bfloat16
EPS = 1e-6


def test_norms_refuse_weights_not_prepared_at_load_time():
    x = torch.randn(3, 64, dtype=BF16)
    with pytest.raises(ValueError, match="rms_weight must be torch.float32"):
        fused.rms_norm(x, torch.ones(64, dtype=BF16), EPS)
    with pytest.raises(ValueError, match=r"rms_weight must have shape \[64\]"):
        fused.rms_norm(x, torch.ones(32), EPS)
    with pytest.raises(ValueError, match="gated_weight must be torch.bfloat16"):
        fused.gated_rms_norm(x.view(3, 2, 32), x.view(3, 2, 32), torch.ones(32), EPS)


def test_norms_refuse_mismatched_inputs():
    x = torch.randn(3, 64, dtype=BF16)
    w = torch.ones(64)
    with pytest.raises(ValueError, match="residual must have x's shape"):
        fused.add_rms_norm(x, x[:2], w, EPS)
    with pytest.raises(ValueError, match="residual must be torch.bfloat16"):
        fused.add_rms_norm(x, x.float(), w, EPS)
    with pytest.raises(ValueError, match="x must be a floating-point tensor"):
        fused.rms_norm(x.int(), w, EPS)
    with pytest.raises(ValueError, match=r"x must be \[T, HV, V\]"):
        fused.gated_rms_norm(x, x, torch.ones(64, dtype=BF16), EPS)
    with pytest.raises(ValueError, match="z must have x's shape"):
        fused.gated_rms_norm(x.view(3, 2, 32), x.view(3, 4, 16), torch.ones(32, dtype=BF16),
                             EPS)


def test_qk_norm_rope_refuses_bad_heads_and_rotary_tables():
    gen = torch.Generator().manual_seed(0)
    q_gate, k = attention_projection(2, 4, 2, 64, BF16, gen)
    w = torch.ones(64)
    cos, sin = rope(2, 16, BF16, gen)
    with pytest.raises(ValueError, match=r"q_gate must be \[T, Hq, 2D\]"):
        fused.qk_norm_rope(q_gate[..., :64], k, w, w, cos, sin, EPS)
    with pytest.raises(ValueError, match="rot = cos.shape"):
        fused.qk_norm_rope(q_gate, k, w, w, cos[:, :15], sin[:, :15], EPS)
    with pytest.raises(ValueError, match=r"cos must have shape \[2, \*\]"):
        fused.qk_norm_rope(q_gate, k, w, w, cos[:1], sin[:1], EPS)
    with pytest.raises(ValueError, match="sin must be torch.bfloat16"):
        fused.qk_norm_rope(q_gate, k, w, w, cos, sin.float(), EPS)


def test_gates_refuse_mismatched_shapes():
    o = torch.randn(2, 4, 8, dtype=BF16)
    with pytest.raises(ValueError, match=r"o must be \[T, Hq, D\] and q_gate \[T, Hq, 2D\]"):
        fused.sigmoid_gate_mul(o, torch.randn(2, 4, 8, dtype=BF16))
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2I\]"):
        fused.silu_mul(torch.randn(2, 7))


def test_rows_past_the_element_paths_limit_run_the_reference(monkeypatch):
    ops = kernels_emu.emulate(monkeypatch)
    gen = torch.Generator().manual_seed(1)
    x = rows(2, 8192, BF16, "misaligned", gen)  # 8192 loads of one element: over 2048
    w = norm_weight(8192, gen)
    close(fused.rms_norm(x, w, EPS), fused.rms_norm_ref(x, w, EPS))
    assert ops.calls == 0
    close(fused.rms_norm(x.contiguous(), w, EPS), fused.rms_norm_ref(x, w, EPS))
    assert ops.calls == 1, "aligned, the same row takes the vector kernel"
