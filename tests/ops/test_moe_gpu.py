"""The MoE block on the GPU: grouped GEMMs with no host sync, captured in a CUDA graph, close
to the reference loop. Shapes of Qwen3.6-35B-A3B's MoE layer (256 experts top-8, hidden 2048,
expert and shared width 512)."""

from __future__ import annotations

import copy

import pytest
import torch

from deltaserve.model.config import ModelConfig
from deltaserve.model.mlp import SparseMoE
from deltaserve.ops.moe import experts_reference, grouped_is_graph_safe, route

pytestmark = pytest.mark.gpu
E, K, H, I = 256, 8, 2048, 512


def _block(seed: int) -> SparseMoE:
    config = ModelConfig.from_dict({
        "model_type": "qwen3_5_moe_text", "hidden_size": H, "num_hidden_layers": 1,
        "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
        "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "vocab_size": 1024, "num_experts": E,
        "num_experts_per_tok": K, "moe_intermediate_size": I,
        "shared_expert_intermediate_size": I, "layer_types": ["linear_attention"]})
    torch.manual_seed(seed)
    block = SparseMoE(config).to("cuda", torch.bfloat16)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5)
    return block.requires_grad_(False)


def _reference(block: SparseMoE, x: torch.Tensor) -> torch.Tensor:
    """The block in fp32 with the reference loop, routed as the bf16 block routes."""
    w, idx = route(block.gate(x), block.top_k, block.norm_topk_prob)
    f = x.float()
    ex = block.experts
    out = experts_reference(f, ex.gate_up_proj.float(), ex.down_proj.float(), idx, w.float())
    shared = copy.deepcopy(block.shared_expert).float()(f)
    return out + torch.sigmoid(f @ block.shared_expert_gate.weight.float().T) * shared


def test_the_h200_runs_the_graph_safe_grouped_path_in_bf16():
    assert grouped_is_graph_safe(torch.device("cuda"), torch.bfloat16)
    assert not grouped_is_graph_safe(torch.device("cuda"), torch.float16)


@pytest.mark.parametrize("tokens", [1, 32, 4096])
def test_the_moe_block_never_syncs_with_the_host_and_matches_the_reference(tokens):
    block = _block(seed=tokens)
    block(torch.randn(tokens, H, device="cuda").bfloat16())  # one-time library set-up
    x = torch.randn(tokens, H, device="cuda").bfloat16()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = block(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    want = _reference(block, x)
    err = (y.float() - want).abs()
    assert y.dtype == torch.bfloat16 and y.isfinite().all()
    assert err.max() < 0.05 * want.abs().max() and err.mean() < 0.02 * want.abs().mean()


def test_a_captured_moe_block_replays_the_eager_result_for_new_inputs():
    block = _block(seed=7)
    x = torch.zeros(32, H, device="cuda", dtype=torch.bfloat16)
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
        x.copy_(torch.randn(32, H, device="cuda", generator=gen))
        graph.replay()
        # bf16 closeness, not bits: cuBLAS may pick other kernels inside a capture
        torch.testing.assert_close(y, block(x))
        replays.append(y.clone())
    assert not torch.equal(replays[0], replays[1])  # the replay read the new inputs
