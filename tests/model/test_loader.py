"""load_model: missing / mis-shaped / unexpected tensors are named; MTP weights are kept."""

from __future__ import annotations

import json
import re

import pytest
import torch
from model_helpers import rewrite_checkpoint
from safetensors.torch import load_file

from deltaserve.model import SUPPORTED_MODEL_TYPES, load_model
from deltaserve.model.merged import merged_parts


def _drop(key: str):
    def edit(tensors):
        assert key in tensors, f"test bug: {key} is not in the checkpoint"
        del tensors[key]
    return edit


@pytest.mark.parametrize(("model_type", "key"), [
    ("qwen3_5_text", "model.layers.1.linear_attn.A_log"),
    ("qwen3_5_text", "model.layers.0.linear_attn.conv1d.weight"),
    ("qwen3_5_text", "lm_head.weight"),
    ("qwen3_5", "model.language_model.layers.3.self_attn.q_norm.weight"),
    ("qwen3_next", "model.layers.2.linear_attn.in_proj_ba.weight"),
    ("qwen3_next", "model.layers.2.linear_attn.in_proj_qkvz.weight"),
    ("qwen3_5_moe_text", "model.layers.2.mlp.experts.5.up_proj.weight"),
    ("qwen3_5_moe_text", "mtp.layers.0.mlp.experts.1.down_proj.weight"),
    ("qwen3_5_text", "mtp.layers.0.self_attn.k_norm.weight"),
    ("qwen3_5_text", "mtp.pre_fc_norm_hidden.weight"),
])
def test_a_missing_tensor_is_named_in_the_error(editable_checkpoint, model_type, key):
    path = editable_checkpoint(model_type)
    rewrite_checkpoint(path, _drop(key))
    with pytest.raises(ValueError, match=r"missing .*" + re.escape(key)):
        load_model(path, torch.float32, progress=False)


@pytest.mark.parametrize(("model_type", "key", "shape"), [
    ("qwen3_5_text", "model.layers.3.self_attn.k_proj.weight", [33, 64]),
    ("qwen3_5_text", "model.layers.0.linear_attn.conv1d.weight", [128, 1, 3]),
    ("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", [190, 64]),
    ("qwen3_5_moe_text", "model.layers.1.mlp.experts.3.gate_proj.weight", [31, 64]),
    ("qwen3_5_text", "mtp.fc.weight", [64, 64]),
])
def test_a_wrongly_shaped_tensor_is_named_with_both_shapes(editable_checkpoint, model_type, key,
                                                           shape):
    path = editable_checkpoint(model_type)
    expected = list(load_file(path / "model.safetensors")[key].shape)

    def edit(tensors):
        tensors[key] = torch.zeros(shape)

    rewrite_checkpoint(path, edit)
    message = f"{key} has shape {shape}, expected {expected}"
    with pytest.raises(ValueError, match=re.escape(message)):
        load_model(path, torch.float32, progress=False)


def test_an_unexpected_tensor_is_an_error_unless_not_strict(editable_checkpoint):
    path = editable_checkpoint("qwen3_5_text")
    key = "model.layers.0.mlp.bogus.weight"

    def edit(tensors):
        tensors[key] = torch.zeros(3)

    rewrite_checkpoint(path, edit)
    with pytest.raises(ValueError, match=re.escape(key)):
        load_model(path, torch.float32, progress=False)
    with pytest.warns(UserWarning, match=re.escape(key)):
        load_model(path, torch.float32, strict=False, progress=False)


def test_vision_tower_tensors_are_skipped_silently(tiny_checkpoint):
    path = tiny_checkpoint("qwen3_5")
    assert any(k.startswith("model.visual.") for k in load_file(path / "model.safetensors"))
    model = load_model(path, torch.float32, progress=False)
    assert not any("visual" in name for name in model.state_dict())


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe", "qwen3_next"])
def test_mtp_weights_are_loaded_equal_to_the_saved_tensors(tiny_checkpoint, model_type):
    path = tiny_checkpoint(model_type)
    saved = {k: v for k, v in load_file(path / "model.safetensors").items()
             if k.startswith("mtp.")}
    model = load_model(path, torch.float32, progress=False)
    assert model.mtp is not None and model.mtp.num_layers == 1
    params = model.state_dict()
    merged = merged_parts(model)
    assert {k for k in params if k.startswith("mtp.")}, "no mtp.* parameters"
    for key, value in saved.items():
        if m := re.match(r"(.*\.experts)\.(\d+)\.(\w+)_proj\.weight$", key):
            base, e, part = m.group(1), int(m.group(2)), m.group(3)
            stacked = params[f"{base}.{'down' if part == 'down' else 'gate_up'}_proj"][e]
            inter = stacked.shape[0] // 2
            got = {"gate": stacked[:inter], "up": stacked[inter:], "down": stacked}[part]
        elif key.endswith("conv1d.weight"):
            continue  # no conv in an attention layer
        elif key in merged:  # one row range of a merged projection
            target, start, rows = merged[key]
            got = params[target][start:start + rows]
        else:
            got = params[key]
        assert torch.equal(got, value), key
    # every mtp parameter was covered by a saved tensor (nothing random left)
    assert len([k for k in params if k.startswith("mtp.")]) <= len(saved)


def test_a_checkpoint_without_mtp_loads_without_the_head(tiny_checkpoint, editable_checkpoint):
    assert load_model(tiny_checkpoint("qwen3_5_text", with_mtp=False), torch.float32,
                      progress=False).mtp is None
    path = editable_checkpoint("qwen3_5_text")  # config.json still announces one MTP layer
    rewrite_checkpoint(path, lambda t: [t.pop(k) for k in [k for k in t if k.startswith("mtp.")]])
    with pytest.warns(UserWarning, match="no mtp"):
        model = load_model(path, torch.float32, progress=False)
    assert model.mtp is None


def test_an_unknown_model_type_lists_the_supported_ones(editable_checkpoint):
    path = editable_checkpoint("qwen3_5_text")
    raw = json.loads((path / "config.json").read_text())
    raw["model_type"] = "llama"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="llama") as info:
        load_model(path, torch.float32, progress=False)
    for model_type in SUPPORTED_MODEL_TYPES:
        assert model_type in str(info.value)


def test_the_model_is_loaded_onto_the_requested_dtype_and_device(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3_next"), torch.float16, "cpu", progress=False)
    dtypes = {(name.endswith(("A_log", "dt_bias")), p.dtype)
              for name, p in model.named_parameters()}
    # the GDN gate parameters are prepared once in the kernels' fp32, everything else as asked
    assert dtypes == {(False, torch.float16), (True, torch.float32)}
    assert model.rotary.inv_freq.dtype == torch.float32  # RoPE tables stay fp32
    assert model.device.type == "cpu" and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    assert model.attention_layer_ids == (3,) and model.num_gdn_layers == 3
    assert [g.gdn_id for g in model.gdn_layers] == [0, 1, 2]


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_next"])
def test_the_loader_merges_projections_and_logs_the_layout(tiny_checkpoint, model_type, caplog):
    path = tiny_checkpoint(model_type)
    with caplog.at_level("INFO", logger="deltaserve.model"):
        model = load_model(path, torch.float32, progress=False)
    line = next(r.getMessage() for r in caplog.records if "merged projections" in r.getMessage())
    for part in ("q_proj", "k_proj", "v_proj", "in_proj_qkv", "in_proj_z", "in_proj_b",
                 "in_proj_a", "gate_proj", "up_proj"):
        assert part in line
    gdn = model.layers[0].linear_attn
    c = model.config
    hv = c.linear_num_value_heads
    assert gdn.in_proj.weight.shape == (c.conv_dim + hv * c.linear_value_head_dim + 2 * hv,
                                        c.hidden_size)
    if model_type == "qwen3_5_text":  # the parts' rows are the checkpoint's tensors, in order
        saved = load_file(path / "model.safetensors")
        rows = merged_parts(model)["layers.0.linear_attn.in_proj_b.weight"]
        start, n = rows[1], rows[2]
        want = saved["model.layers.0.linear_attn.in_proj_b.weight"]
        assert torch.equal(gdn.in_proj.weight[start:start + n], want)
    # prepared once: fp32 gate parameters, fp32 1 + w of every zero-centred norm
    assert gdn.A_log.dtype == torch.float32
    norm = model.layers[0].input_layernorm
    assert torch.equal(norm.rms_weight, 1.0 + norm.weight.float())


def test_a_truncated_safetensors_file_is_a_value_error_naming_it(editable_checkpoint):
    path = editable_checkpoint("qwen3_5_text")
    shard = sorted(path.glob("*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:5])
    with pytest.raises(ValueError, match="not a readable safetensors file") as e:
        load_model(path, torch.float32, progress=False)
    assert shard.name in str(e.value)


@pytest.mark.parametrize(("level", "drawn"), [("WARNING", True), ("ERROR", False)])
def test_the_progress_bar_is_drawn_unless_logging_asks_for_errors_only(tiny_checkpoint, capsys,
                                                                       level, drawn):
    import logging

    log = logging.getLogger("deltaserve")
    before = log.level
    log.setLevel(level)
    try:
        load_model(tiny_checkpoint("qwen3_5_text"), torch.float32)
    finally:
        log.setLevel(before)
    assert ("Loading" in capsys.readouterr().err) is drawn
