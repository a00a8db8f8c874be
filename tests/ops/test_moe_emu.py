"""The MoE decode kernels' own code (csrc/kernels/moe_route.cuh, moe_experts.cuh), run on the
CPU by the emulated device runtime (kernels_emu.py) through `ops.moe_fused.moe_fused`, against
the pure-torch reference on fresh random inputs: routing (ties included) and the grouping of
(token, slot) pairs exactly, the block's output within the rounding contract. Shapes stay small
(a block's 128 threads run as fibers); they reach every path: 1..16 and > 16 rows an expert
(several tiles), a shared expert of another width or none, H and I off the 32-column and the
32-element chunk grids, blocks that walk more than one work item, bf16 and fp16.
tests/ops/test_moe_gpu.py owns the real sizes."""

from __future__ import annotations

import re

import kernels_emu
import pytest
import torch
from moe_inputs import assert_close_to_reference, block_inputs

from deltaserve.ops import _ext
from deltaserve.ops import moe_fused as mf


@pytest.fixture
def emu(monkeypatch):
    return kernels_emu.emulate(monkeypatch)


def _block(t, e, h, i, si, seed, dtype=torch.bfloat16):
    return block_inputs(t, e, h, i, si, torch.Generator().manual_seed(seed), dtype)


@pytest.mark.parametrize("t,e,k,shared", [(1, 8, 2, True), (5, 64, 8, False), (33, 300, 4, True),
                                          (40, 16, 8, True)])
@pytest.mark.parametrize("norm", [True, False])
def test_emulated_route_ranks_weighs_and_groups_as_the_reference(t, e, k, shared, norm):
    gen = torch.Generator().manual_seed(t * e + k)
    logits = torch.randn(t, e + shared, generator=gen).bfloat16()
    logits[: t // 2, 3:7] = logits[: t // 2, 3:4]  # ties at the top-k boundary and inside it
    logits[0, 1] = -0.0
    logits[0, 2] = 0.0
    ops = kernels_emu.load()
    weight, expert, pair_row, row_token, tiles, n_tiles, scale, counters = ops.moe_route(
        logits, e, k, norm, shared, 96)
    want_w, want_i = mf.route_fused_reference(logits, e, k, norm)
    assert torch.equal(expert.long(), want_i)
    torch.testing.assert_close(weight, want_w, atol=1e-6, rtol=1e-6)
    want_pr, want_rt, want_tiles, n_shared = mf.grouping_reference(want_i, e, shared)
    assert torch.equal(pair_row.long(), want_pr) and torch.equal(row_token.long(), want_rt)
    assert n_tiles.tolist() == [n_shared, want_tiles.shape[0]]
    assert torch.equal(tiles[: want_tiles.shape[0]].long(), want_tiles)
    assert counters.numel() == t * 3 and not counters.any()
    if shared:
        torch.testing.assert_close(scale, torch.sigmoid(logits[:, e].float()))


def test_moe_route_meta_shapes_are_the_emulated_op_shapes():
    ops = kernels_emu.load()
    for t, e, k, shared in ((1, 8, 2, True), (40, 300, 16, False)):
        logits = torch.zeros(t, e + shared, dtype=torch.bfloat16)
        real = ops.moe_route(logits, e, k, True, shared, 72)
        fake = ops.moe_route(logits.to("meta"), e, k, True, shared, 72)
        assert [(r.shape, r.dtype) for r in real] == [(f.shape, f.dtype) for f in fake]


@pytest.mark.parametrize("t", [1, 3, 8, 17])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_moe_block_matches_the_reference(emu, t, dtype):
    x, logits, gate_up, down, sgu, sdn = _block(t, 16, 64, 32, 48, seed=t, dtype=dtype)
    got = mf.moe_fused(x, logits, gate_up, down, 4, True, sgu, sdn)
    assert emu.calls == 2, "the wrapper ran the reference, not the emulated kernels"
    assert_close_to_reference(got, mf.moe_fused_reference(x, logits, gate_up, down, 4, True,
                                                          sgu, sdn))


def _more_than_16_rows(logits):
    logits[:, 5] = 50.0  # every token picks expert 5: 40 rows, three tiles (and 3 shared tiles)
    logits[::3, 2] = 40.0


# off the grids: H = 72 (down's last 32-column group partial, gate_up's K ends mid-chunk),
# I = 24 (three gate_up column groups, down's K < one chunk), no shared expert, no norm;
# full grid: gate_up's items, 64 routed tiles x 11 column groups + 4 shared tiles x 2 = 712, are
# more than the 132 x 5 resident blocks, which then walk several items
@pytest.mark.parametrize("case,shape,k,norm,shared,edit", [
    ("off the grids", (6, 12, 72, 24), 3, False, 0, None),
    ("an expert with more than 16 rows", (40, 8, 32, 16), 2, True, 16, _more_than_16_rows),
    ("full grid", (64, 64, 32, 88), 8, True, 16, None)])
def test_emulated_moe_block_matches_the_reference_in_every_layout(emu, case, shape, k, norm,
                                                                  shared, edit):
    x, logits, gate_up, down, sgu, sdn = _block(*shape, shared, seed=len(case))
    if edit is not None:
        edit(logits)
    got = mf.moe_fused(x, logits, gate_up, down, k, norm, sgu, sdn)
    assert emu.calls == 2
    assert_close_to_reference(got, mf.moe_fused_reference(x, logits, gate_up, down, k, norm,
                                                          sgu, sdn))


def test_emulated_moe_gives_a_token_the_same_bits_alone_and_in_a_batch(emu):
    x, logits, gate_up, down, sgu, sdn = _block(9, 16, 64, 32, 32, seed=5)
    batch = mf.moe_fused(x, logits, gate_up, down, 4, True, sgu, sdn)
    for i in (0, 4, 8):
        alone = mf.moe_fused(x[i:i + 1], logits[i:i + 1], gate_up, down, 4, True, sgu, sdn)
        assert torch.equal(alone, batch[i:i + 1])


def test_the_sparse_moe_block_takes_the_kernels_in_bf16(emu, tmp_path):
    from deltaserve.model.loader import load_model
    from deltaserve.model.mlp import SparseMoE
    from deltaserve.model.testing import make_tiny_checkpoint

    model = load_model(make_tiny_checkpoint(tmp_path / "m", "qwen3_next"), torch.float32,
                       progress=False)
    block = next(m for m in model.modules() if isinstance(m, SparseMoE)).to(torch.bfloat16)
    x = torch.randn(5, block.router.weight.shape[1], generator=torch.Generator().manual_seed(6))
    got = block(x.bfloat16())
    # the router GEMM (gemv at 5 rows), then routing and the experts: one launch each
    assert {k: emu.by_op.get(k, 0) for k in ("moe_route", "moe_experts")} == {
        "moe_route": 1, "moe_experts": 1}
    monkey = pytest.MonkeyPatch()
    monkey.setattr(mf, "FUSED_MAX_TOKENS", 0)  # the grouped / reference path
    try:
        want = block(x.bfloat16())
    finally:
        monkey.undo()
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case,message", [
    ("tokens", "1..256 tokens"), ("logits", "logits must be [T, E]"),
    ("x", "x must be [T, H]"), ("down", "and down [E, H, I]"), ("weight", "weight must be"),
    ("shared", "come together")])
def test_emulated_moe_bindings_name_the_bad_argument(case, message):
    ops = kernels_emu.load()
    x, logits, gate_up, down, sgu, sdn = _block(3, 8, 32, 16, 16, seed=7)
    if case == "tokens":
        logits = torch.zeros(257, 9, dtype=torch.bfloat16)
    if case == "logits":
        logits = logits[:, :8]
    with pytest.raises(RuntimeError, match=re.escape(message)):
        route = ops.moe_route(logits, 8, 2, True, True, 32)
        weight, _, pair_row, row_token, tiles, n_tiles, scale, counters = route
        if case == "x":
            x = x[:, :16]
        if case == "down":
            down = down[:, :, :8].contiguous()
        if case == "weight":
            weight = weight.reshape(-1)
        if case == "shared":
            sdn = None
        ops.moe_experts(x, gate_up, down, sgu, sdn, weight, pair_row, row_token, tiles, n_tiles,
                        scale, counters)


def test_bad_moe_arguments_raise_value_errors():
    x, logits, gate_up, down, sgu, sdn = _block(3, 8, 32, 16, 16, seed=8)
    with pytest.raises(ValueError, match="logits must be"):
        mf.moe_fused(x, logits[:, :8], gate_up, down, 2, True, sgu, sdn)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        mf.moe_fused(x, logits, gate_up, down, 9, True, sgu, sdn)
    with pytest.raises(ValueError, match="given together"):
        mf.moe_fused(x, logits, gate_up, down, 2, True, sgu, None)
    with pytest.raises(ValueError, match="one float dtype"):
        mf.moe_fused(x.half(), logits, gate_up, down, 2, True, sgu, sdn)
    with pytest.raises(ValueError, match="DS_MOE_FUSED_MAX_TOKENS must be an integer in 0..256"):
        _ext.count_from_env("DS_MOE_FUSED_MAX_TOKENS", 256, 256, "300")
