"""Model logits equal transformers' on the same tiny checkpoints (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from model_helpers import Sequence, fuse_experts, rewrite_checkpoint, shard_checkpoint

from deltaserve.model import load_model
from deltaserve.model.testing import transformers_logits

ATOL = RTOL = 1e-4
VARIANTS = [
    ("qwen3_5_text", {}),
    ("qwen3_5", {}),  # multimodal wrapper: model.language_model.* keys, vision tower skipped
    ("qwen3_5_moe_text", {}),
    ("qwen3_5_moe", {}),
    ("qwen3_next", {}),
    ("qwen3_next", {"mlp_only_layers": [1], "decoder_sparse_step": 1}),  # dense + MoE layers
    ("qwen3_5_text", {"tie_word_embeddings": True}),
    ("qwen3_5_text", {"layer_types": ["full_attention", "linear_attention",
                                      "full_attention", "linear_attention"]}),
]


def _ids(n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize(("model_type", "overrides"), VARIANTS,
                         ids=[f"{t}-{'-'.join(o) or 'base'}" for t, o in VARIANTS])
def test_logits_match_transformers_over_a_multi_chunk_prompt(tiny_checkpoint, model_type,
                                                             overrides):
    path = tiny_checkpoint(model_type, **overrides)
    ids = _ids(70)  # > 64: transformers' chunked GDN runs two chunks
    want = transformers_logits(path, ids)
    got = Sequence(load_model(path, torch.float32, "cpu", progress=False)).feed(ids)
    assert want.std() > 1.0, "tiny checkpoint logits are degenerate"
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_prefill_then_decode_steps_match_one_shot_logits(tiny_checkpoint, model_type):
    path = tiny_checkpoint(model_type)
    ids = _ids(24, seed=2)
    want = transformers_logits(path, ids)
    seq = Sequence(load_model(path, torch.float32, "cpu", progress=False))
    parts = [seq.feed(ids[:13])] + [seq.feed(ids[i:i + 1]) for i in range(13, 20)]
    parts.append(seq.feed(ids[20:]))  # a short chunk after decode steps
    torch.testing.assert_close(torch.cat(parts), want, atol=ATOL, rtol=RTOL)


def test_stacked_expert_checkpoint_loads_the_same_weights_as_per_expert(tiny_checkpoint,
                                                                         editable_checkpoint):
    per_expert = load_model(tiny_checkpoint("qwen3_5_moe"), torch.float32, progress=False)
    path = editable_checkpoint("qwen3_5_moe")
    rewrite_checkpoint(path, fuse_experts)
    stacked = load_model(path, torch.float32, progress=False)
    want = per_expert.state_dict()
    for name, value in stacked.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_sharded_checkpoint_with_index_loads_the_same_weights(tiny_checkpoint,
                                                              editable_checkpoint):
    single = load_model(tiny_checkpoint("qwen3_next"), torch.float32, progress=False)
    path = editable_checkpoint("qwen3_next")
    shard_checkpoint(path, num_shards=3)
    sharded = load_model(path, torch.float32, progress=False)
    want = single.state_dict()
    assert sharded.state_dict().keys() == want.keys()
    for name, value in sharded.state_dict().items():
        assert torch.equal(value, want[name]), name


def test_hidden_sink_receives_the_returned_final_hidden(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_5_text"), torch.float32, progress=False)
    seen = []
    seq = Sequence(model, hidden_sink=seen.append)
    hidden = model(_ids(5), seq.context(5))
    assert len(seen) == 1 and seen[0] is hidden and hidden.shape == (5, 64)


def test_bfloat16_model_tracks_the_fp32_model(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5_text")
    ids = _ids(20, seed=3)
    fp32 = Sequence(load_model(path, torch.float32, progress=False)).feed(ids)
    model = load_model(path, "bfloat16", progress=False)
    assert all(p.dtype == torch.bfloat16 for name, p in model.named_parameters()
               if not name.endswith(("A_log", "dt_bias")))  # those two: fp32 (prepare.py)
    bf16 = Sequence(model).feed(ids)
    assert bf16.dtype == torch.float32
    # bf16 rounding noise only (transformers' own bf16 path is as far from its fp32 one)
    assert (bf16 - fp32).abs().mean() < 0.05 * fp32.std()


@pytest.mark.gpu
@pytest.mark.parametrize("model_type", ["qwen3_5", "qwen3_5_moe_text", "qwen3_next"])
def test_a_model_loaded_onto_cuda_computes_the_cpu_logits(tiny_checkpoint, model_type):
    path = tiny_checkpoint(model_type)
    ids = _ids(40, seed=5)
    cpu = Sequence(load_model(path, torch.float32, "cpu", progress=False)).feed(ids)
    model = load_model(path, torch.float32, "cuda", progress=False)
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert model.rotary.inv_freq.device.type == "cuda"
    gpu = Sequence(model).feed(ids.cuda()).cpu()
    torch.testing.assert_close(gpu, cpu, atol=1e-3, rtol=1e-3)
    bf16 = Sequence(load_model(path, torch.bfloat16, "cuda", progress=False)).feed(ids.cuda())
    # bf16 rounding noise (MoE routing may flip on a few rows)
    assert bf16.isfinite().all() and (bf16.cpu() - cpu).abs().mean() < 0.1 * cpu.std()
