"""The MoE block on the GPU: no host sync, captured in a CUDA graph, close to the fp32 reference
loop, on both of its paths (the extension's kernels up to FUSED_MAX_TOKENS tokens, the grouped
GEMMs above). Shapes of Qwen3.6-35B-A3B's MoE layer (256 experts top-8, hidden 2048, expert and
shared width 512). The kernels themselves against their reference: test_moe_fused_gpu.py."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig

from deltaserve.model.config import ModelConfig
from deltaserve.model.mlp import SparseMoE, moe_graph_safe
from deltaserve.ops import moe_fused
from deltaserve.ops.moe import experts_reference, grouped_is_graph_safe

pytestmark = pytest.mark.gpu
E, K, H, I = 256, 8, 2048, 512


def _block(seed: int, dtype=torch.bfloat16) -> SparseMoE:
    # transformers' Qwen3_5MoeTextConfig defaults: Qwen3.5/3.6-35B-A3B's shapes
    config = ModelConfig.from_dict(Qwen3_5MoeTextConfig(num_hidden_layers=1).to_dict())
    torch.manual_seed(seed)
    with torch.device("cuda"):  # made on the GPU: 1.6 G parameters
        block = SparseMoE(config).to(dtype)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.requires_grad_(False)


def _reference(block: SparseMoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The block in fp32 with the reference loop, routed on the block's own logits with ties to
    the lower expert (the kernels' rule); and the tokens whose k-th and (k+1)-th logits tie
    (where torch.topk on the grouped path may pick another expert: the near-tie rule leaves them
    out there)."""
    logits = block.router(x)
    w, idx = moe_fused.route_fused_reference(logits, E, K, block.norm_topk_prob)
    ranked = logits[:, :E].sort(dim=-1, descending=True).values
    tied = ranked[:, K - 1] == ranked[:, K]
    f = x.float()
    ex = block.experts
    out = experts_reference(f, ex.gate_up_proj.float(), ex.down_proj.float(), idx, w)
    shared = copy.deepcopy(block.shared_expert).float()(f)
    return out + torch.sigmoid(logits[:, E:].float()) * shared, tied


def test_the_h200_runs_the_graph_safe_grouped_path_in_bf16():
    assert grouped_is_graph_safe(torch.device("cuda"), torch.bfloat16)
    assert not grouped_is_graph_safe(torch.device("cuda"), torch.float16)


def test_moe_models_in_bf16_and_fp16_are_graph_safe_up_to_the_kernels_limit():
    for dtype in (torch.bfloat16, torch.float16):
        block = _block(seed=1, dtype=dtype)
        assert moe_graph_safe(block, rows=moe_fused.FUSED_MAX_TOKENS)


@pytest.mark.parametrize("tokens,kernels", [(1, True), (32, True), (256, True), (4096, False)])
def test_the_moe_block_never_syncs_with_the_host_and_matches_the_reference(tokens, kernels):
    block = _block(seed=tokens)
    block(torch.randn(tokens, H, device="cuda").bfloat16())  # one-time library set-up
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    ex = block.experts
    assert moe_fused.fused_fits(x, block.router(x), ex.gate_up_proj, ex.down_proj, K,
                                *block._shared_weights()) == kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = block(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want, tied = _reference(block, x)
    if kernels:  # the kernels break ties as the reference does: every token compares
        tied = torch.zeros_like(tied)
    assert tied.float().mean() < 0.5  # bf16 logits tie at the k-th place for ~1 token in 10
    err = (y.float() - want).abs()[~tied]
    scale = want[~tied].abs()
    assert y.dtype == torch.bfloat16 and y.isfinite().all()
    assert err.max() < 0.05 * scale.max() and err.mean() < 0.02 * scale.mean()


@pytest.mark.parametrize("tokens", [32, 512])
def test_a_captured_moe_block_replays_the_eager_result_for_new_inputs(tokens):
    block = _block(seed=7)
    x = torch.zeros(tokens, H, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(x)  # warm-up outside the capture (workspace, cuBLAS handles)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = block(x)
    replays = []
    for seed in (1, 2):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        x.copy_(torch.randn(tokens, H, device="cuda", generator=gen))
        graph.replay()
        # bf16 closeness, not bits: cuBLAS may pick other router kernels inside a capture
        torch.testing.assert_close(y, block(x))
        replays.append(y.clone())
    assert not torch.equal(replays[0], replays[1])  # the replay read the new inputs
