"""MoE ops on CPU: the grouped (static-shape) form against the reference loop, no host sync
in the grouped form, and top-k ties routed as transformers routes them."""

from __future__ import annotations

import pytest
import torch
import torch._dynamo

from deltaserve.ops.moe import (
    GATHER_BYTES,
    ExpertRows,
    experts_gathered,
    experts_graph_safe,
    experts_grouped,
    experts_reference,
    gather_fits,
    route,
    route_topk_first,
)


def _weights(e: int, h: int, i: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    gate_up = (torch.randn(e, 2 * i, h, generator=gen) * h ** -0.5).to(dtype)
    down = (torch.randn(e, h, i, generator=gen) * i ** -0.5).to(dtype)
    return gate_up, down


def _routed(t: int, e: int, k: int, h: int, seed: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(t, h, generator=gen).to(dtype)
    weight, idx = route(torch.randn(t, e, generator=gen).to(dtype), k, norm_topk_prob=True)
    return x, idx, weight


@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 8, 2), (33, 16, 4), (5, 64, 8)])
def test_grouped_experts_compute_the_reference_loop_in_fp32(t, e, k):
    gate_up, down = _weights(e, 32, 16, seed=t)
    x, idx, weight = _routed(t, e, k, 32, seed=t)
    got = experts_grouped(x, gate_up, down, idx, weight)
    torch.testing.assert_close(got, experts_reference(x, gate_up, down, idx, weight),
                               atol=1e-5, rtol=1e-5)


def test_grouped_experts_add_the_gated_shared_expert():
    gate_up, down = _weights(8, 32, 16, seed=3)
    x, idx, weight = _routed(6, 8, 2, 32, seed=3)
    gen = torch.Generator().manual_seed(9)
    shared, gate = torch.randn(6, 32, generator=gen), torch.randn(6, 1, generator=gen)
    want = experts_reference(x, gate_up, down, idx, weight) + torch.sigmoid(gate) * shared
    got = experts_grouped(x, gate_up, down, idx, weight, shared, gate)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_expert_rows_group_each_expert_in_token_order_with_cumulative_ends():
    idx = torch.tensor([[3, 0], [0, 3], [1, 3]])
    rows = ExpertRows(idx, num_experts=5)
    # sorted pairs: expert 0 <- (0,1), (1,0); expert 1 <- (2,0); expert 3 <- (0,0), (1,1), (2,1)
    assert rows.order.tolist() == [1, 2, 4, 0, 3, 5]
    assert rows.token.tolist() == [0, 1, 2, 0, 1, 2]
    assert rows.offsets.tolist() == [2, 3, 3, 6, 6]
    assert rows.offsets.dtype == torch.int32


def _traces_whole(fn, *args) -> bool:
    """Whether dynamo captures fn as one graph: a host sync (.item / .tolist, a data-dependent
    shape such as `unique` or `nonzero`) breaks the graph, which fullgraph=True turns into an
    error."""
    torch._dynamo.reset()
    try:
        torch.compile(fn, fullgraph=True, backend="eager")(*args)
    except Exception:  # dynamo's Unsupported / data-dependent guard errors
        return False
    finally:
        torch._dynamo.reset()
    return True


def test_the_grouped_form_runs_without_host_sync_and_the_loop_does_not():
    # bf16: the dtype of the graph-safe GPU path (and the only float dtype grouped_mm's meta
    # function takes, which dynamo traces with)
    gate_up, down = _weights(16, 32, 16, seed=4, dtype=torch.bfloat16)
    x, idx, weight = _routed(9, 16, 4, 32, seed=4, dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    shared = torch.randn(9, 32, generator=gen).bfloat16()
    gate = torch.randn(9, 1, generator=gen).bfloat16()

    def moe_block(x, logits, shared, gate):
        w, i = route(logits, 4, norm_topk_prob=True)
        w_cuda_form, _ = route_topk_first(logits, 4)  # the form route takes on CUDA
        return experts_grouped(x, gate_up, down, i, w, shared, gate) + w_cuda_form.sum()

    logits = torch.randn(9, 16, generator=gen).bfloat16()
    assert _traces_whole(moe_block, x, logits, shared, gate)
    assert not _traces_whole(experts_reference, x, gate_up, down, idx, weight)


def test_a_router_with_tied_scores_picks_the_experts_transformers_picks():
    from transformers import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeTopKRouter

    e, k, h = 16, 4, 8
    config = Qwen3_5MoeTextConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k)
    router = Qwen3_5MoeTopKRouter(config)
    gen = torch.Generator().manual_seed(6)
    weight = torch.randn(e, h, generator=gen)
    # equal rows give equal logits: ties among experts 5..8 and among 12..14
    weight[5:9] = weight[5]
    weight[12:15] = weight[12] * 1.5
    with torch.no_grad():
        router.weight.copy_(weight)
    x = torch.randn(64, h, generator=gen)
    logits = torch.nn.functional.linear(x, weight)
    assert (logits[:, 5:9] == logits[:, 5:6]).all()
    _, want_weight, want_idx = router(x)
    got_weight, got_idx = route(logits, k, norm_topk_prob=True)
    ranked = torch.softmax(logits, -1).sort(-1, descending=True).values
    assert (ranked[:, k - 1] == ranked[:, k]).sum() >= 10  # tokens whose k-th place is a tie
    assert torch.equal(got_idx, want_idx)
    assert torch.equal(got_weight, want_weight)


def test_bad_router_and_expert_arguments_raise_value_errors():
    gate_up, down = _weights(8, 32, 16, seed=1)
    x, idx, weight = _routed(3, 8, 2, 32, seed=1)
    with pytest.raises(ValueError, match="top_k must be in 1..8"):
        route(torch.zeros(3, 8), 9, norm_topk_prob=True)
    with pytest.raises(ValueError, match="x must be"):
        experts_grouped(x[:, :16], gate_up, down, idx, weight)
    with pytest.raises(ValueError, match="down must be"):
        experts_grouped(x, gate_up, down[:, :, :8], idx, weight)
    with pytest.raises(ValueError, match="top_idx must be"):
        experts_grouped(x, gate_up, down, idx.int(), weight)
    with pytest.raises(ValueError, match="shared and shared_gate"):
        experts_grouped(x, gate_up, down, idx, weight, shared=x)


@pytest.mark.parametrize("t,k", [(1, 2), (12, 4)])
def test_gathered_experts_compute_the_reference_loop_with_the_gated_shared_expert(t, k):
    gate_up, down = _weights(16, 32, 16, seed=5)
    x, idx, weight = _routed(t, 16, k, 32, seed=5)
    gen = torch.Generator().manual_seed(3)
    shared, gate = torch.randn(t, 32, generator=gen), torch.randn(t, 1, generator=gen)
    want = experts_reference(x, gate_up, down, idx, weight) + torch.sigmoid(gate) * shared
    got = experts_gathered(x, gate_up, down, idx, weight, shared, gate)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_the_gathered_form_runs_without_host_sync():
    gate_up, down = _weights(16, 32, 16, seed=4)
    x, idx, weight = _routed(9, 16, 4, 32, seed=4)
    assert _traces_whole(experts_gathered, x, gate_up, down, idx, weight)


def test_graph_safety_needs_a_gpu_and_the_gathered_copy_within_its_budget():
    gate_up = torch.empty(8, 2 * 512, 2048, dtype=torch.bfloat16, device="meta")
    per_pair = 3 * 512 * 2048 * 2
    assert gather_fits(GATHER_BYTES // per_pair, gate_up)
    assert not gather_fits(GATHER_BYTES // per_pair + 1, gate_up)
    assert not experts_graph_safe(torch.device("cpu"), torch.bfloat16, 1, 8, gate_up)


def test_dense_models_keep_cuda_graphs_and_cpu_moe_models_report_no_graph_path(tmp_path):
    from deltaserve.model.loader import load_model
    from deltaserve.model.mlp import moe_graph_safe
    from deltaserve.model.testing import make_tiny_checkpoint

    dense = load_model(make_tiny_checkpoint(tmp_path / "d", "qwen3_5_text", with_mtp=False),
                       torch.float32, progress=False)
    sparse = load_model(make_tiny_checkpoint(tmp_path / "s", "qwen3_5_moe_text"),
                        torch.float32, progress=False)
    assert moe_graph_safe(dense, rows=64)
    assert not moe_graph_safe(sparse, rows=64)  # CPU: no graphs to capture


def test_routing_top_k_first_picks_the_same_experts_and_weights_as_the_reference():
    gen = torch.Generator().manual_seed(8)
    logits = torch.randn(200, 64, generator=gen)
    logits[:50, 10:14] = logits[:50, 10:11]  # 4-way ties among experts 10..13
    want_w, want_i = route(logits, 8, norm_topk_prob=True)
    got_w, got_i = route_topk_first(logits, 8)
    assert torch.equal(got_i, want_i)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)
