"""ModelConfig parsing: model types, wrappers, derived layer maps, legacy RoPE fields."""

from __future__ import annotations

import json

import pytest

from deltaserve.model import SUPPORTED_MODEL_TYPES, ModelConfig

# The shape of a Hub Qwen3.5 (multimodal wrapper) config.json, dims shrunk.
QWEN3_5_WRAPPER = {
    "model_type": "qwen3_5",
    "tie_word_embeddings": True,
    "text_config": {
        "model_type": "qwen3_5_text", "vocab_size": 1000, "hidden_size": 128,
        "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 2,
        "head_dim": 32, "intermediate_size": 256, "full_attention_interval": 4,
        "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 32,
        "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "rms_norm_eps": 1e-6,
        "max_position_embeddings": 262144, "eos_token_id": 7, "mtp_num_hidden_layers": 1,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7,
                            "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10],
                            "mrope_interleaved": True},
        "dtype": "bfloat16",
    },
    "vision_config": {"depth": 2},
}

# Qwen3-Next's config.json keeps RoPE fields at the top level (no rope_parameters).
QWEN3_NEXT = {
    "model_type": "qwen3_next", "vocab_size": 1000, "hidden_size": 128, "num_hidden_layers": 6,
    "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 64,
    "intermediate_size": 256, "layer_types": ["linear_attention", "full_attention"] * 3,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 32,
    "linear_value_head_dim": 32, "num_experts": 16, "num_experts_per_tok": 4,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
    "decoder_sparse_step": 2, "mlp_only_layers": [3], "rope_theta": 5e6,
    "partial_rotary_factor": 0.5, "rope_scaling": None, "eos_token_id": [1, 2],
}


def test_an_unknown_model_type_lists_every_supported_one():
    with pytest.raises(ValueError) as info:
        ModelConfig.from_dict({"model_type": "qwen3"})
    assert "'qwen3'" in str(info.value)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)


def test_the_multimodal_wrapper_uses_its_text_config_and_top_level_tie(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(QWEN3_5_WRAPPER))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 7]}))
    c = ModelConfig.from_pretrained(tmp_path)
    assert (c.model_type, c.family, c.hidden_size, c.num_experts) == ("qwen3_5", "qwen3_5", 128, 0)
    assert c.tie_word_embeddings
    assert c.eos_token_ids == (7, 9)  # config.json's first, then generation_config's
    assert c.eos_token_id == [7, 9]
    assert c.rope_theta == 1e7 and c.rotary_dim == 8
    assert c.mrope_section == (11, 11, 10) and c.mrope_interleaved
    assert c.mtp_num_hidden_layers == 1 and c.mtp_layer_ids == (8,)
    assert c.torch_dtype == "bfloat16" and not c.fused_gdn_projections


def test_layer_types_follow_full_attention_interval_when_absent():
    c = ModelConfig.from_dict(QWEN3_5_WRAPPER)
    assert c.layer_types == ("linear_attention",) * 3 + ("full_attention",) \
        + ("linear_attention",) * 3 + ("full_attention",)
    assert c.gdn_layer_ids == (0, 1, 2, 4, 5, 6) and c.attention_layer_ids == (3, 7)
    assert c.gdn_index == {0: 0, 1: 1, 2: 2, 4: 3, 5: 4, 6: 5}
    assert c.num_gdn_layers == 6 and c.num_attention_layers == 2
    assert c.conv_dim == 2 * 4 * 32 + 8 * 16


def test_qwen3_next_legacy_rope_fields_and_sparse_layer_rule():
    c = ModelConfig.from_dict(QWEN3_NEXT)
    assert c.fused_gdn_projections and c.family == "qwen3_next"
    assert c.rope_theta == 5e6 and c.partial_rotary_factor == 0.5 and c.rotary_dim == 32
    assert c.eos_token_ids == (1, 2)
    # MoE where (i + 1) % decoder_sparse_step == 0 and i not in mlp_only_layers
    assert [c.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]


def test_qwen3_5_moe_always_renormalises_and_every_layer_is_sparse():
    raw = {**QWEN3_5_WRAPPER, "model_type": "qwen3_5_moe"}
    raw["text_config"] = {**raw["text_config"], "model_type": "qwen3_5_moe_text",
                          "num_experts": 8, "num_experts_per_tok": 2,
                          "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32}
    c = ModelConfig.from_dict(raw)
    assert c.family == "qwen3_5_moe" and c.norm_topk_prob
    assert all(c.is_moe_layer(i) for i in range(c.num_hidden_layers + 1))


@pytest.mark.parametrize(("field", "value", "message"), [
    ("hidden_act", "gelu", "hidden_act"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 4.0}, "rope_type"),
    ("layer_types", ["full_attention"] * 5, "layer_types"),
])
def test_unsupported_settings_are_rejected_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**QWEN3_NEXT, field: value})


@pytest.mark.parametrize("text, says", [
    ('{"model_type": "qwen3_5_text"}', "a field is missing or malformed"),
    ('{"model_type": "qwen3_5", "text_config": [1]}', "a field is missing or malformed"),
    ("[1, 2]", "must hold a JSON object, not list"),
    ('{model_type: 1}', "not valid JSON"),
])
def test_a_broken_config_json_is_a_value_error_naming_the_file(tmp_path, text, says):
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=says) as e:
        ModelConfig.from_pretrained(tmp_path)
    assert str(tmp_path / "config.json") in str(e.value)
