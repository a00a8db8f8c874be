"""ops.linear.linear on the CPU: exactly F.linear (the CPU path stays bitwise what it was),
clear errors on mismatched shapes, and the DS_GEMV_MAX_ROWS switch read at import."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltaserve.model.merged import Linear
from deltaserve.ops import linear as linear_ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead", [(), (1,), (3,), (2, 5), (40,)])
@pytest.mark.parametrize("bias", [False, True])
def test_cpu_linear_is_bitwise_f_linear(dtype, lead, bias):
    gen = torch.Generator().manual_seed(len(lead) + 7 * bias)
    x = torch.randn(*lead, 24, generator=gen).to(dtype)
    w = torch.randn(10, 24, generator=gen).to(dtype)
    b = torch.randn(10, generator=gen).to(dtype) if bias else None
    y = linear_ops.linear(x, w, b)
    assert y.dtype == dtype and y.shape == (*lead, 10)
    assert torch.equal(y, F.linear(x, w, b))
    assert torch.equal(linear_ops.linear_ref(x, w, b), F.linear(x, w, b))


def test_linear_module_keeps_nn_linear_parameters_and_output():
    torch.manual_seed(0)
    ours, theirs = Linear(16, 8, bias=True), torch.nn.Linear(16, 8, bias=True)
    theirs.load_state_dict(ours.state_dict())
    assert isinstance(ours, torch.nn.Linear) and list(ours.state_dict()) == ["weight", "bias"]
    x = torch.randn(3, 16)
    assert torch.equal(ours(x), theirs(x))


@pytest.mark.parametrize("x_shape,w_shape,b_shape", [
    ((2, 16), (8, 12), None), ((2, 16), (16,), None), ((2, 16), (8, 16), (7,)),
    ((), (8, 16), None)])
def test_linear_names_mismatched_shapes(x_shape, w_shape, b_shape):
    x, w = torch.zeros(x_shape), torch.zeros(w_shape)
    b = None if b_shape is None else torch.zeros(b_shape)
    with pytest.raises(ValueError, match="linear: "):
        linear_ops.linear(x, w, b)


@pytest.mark.parametrize("value,rows", [(None, 8), ("", 8), ("0", 0), ("1", 1), ("8", 8),
                                        ("32", 32)])
def test_max_rows_env_sets_the_row_limit(value, rows):
    assert linear_ops._max_rows_from_env(value, default=8) == rows
    assert linear_ops._max_rows_from_env(value, default=0) == (0 if value in (None, "") else rows)


def test_the_kernel_is_on_by_default_on_cuda_and_off_on_rocm():
    expected = 0 if torch.version.hip else linear_ops.KERNEL_MAX_ROWS
    assert linear_ops.DEFAULT_MAX_ROWS == expected
    assert linear_ops._max_rows_from_env(None) == expected
    assert linear_ops._max_rows_from_env("0") == 0


@pytest.mark.parametrize("value,rows", [(None, 8), ("", 8), ("0", 0), ("16", 16), ("32", 32)])
def test_wide_max_rows_env_sets_the_wide_grid_row_limit(value, rows):
    assert linear_ops._wide_max_rows_from_env(value) == rows
    with pytest.raises(ValueError, match="DS_GEMV_WIDE_MAX_ROWS"):
        linear_ops._wide_max_rows_from_env("33")


@pytest.mark.parametrize("value", ["33", "-1", "four", "2.5"])
def test_max_rows_env_refuses_values_outside_0_to_32(value):
    with pytest.raises(ValueError, match="DS_GEMV_MAX_ROWS"):
        linear_ops._max_rows_from_env(value)
