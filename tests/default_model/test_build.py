"""The random default model: deterministic bytes, atomic caching, loads and runs in transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from deltaserve import default_model
from deltaserve.default_model import build, default_model_path, random_model_path
from deltaserve.default_model.hf_reference import torch_gdn_reference


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return Path(random_model_path(tmp_path_factory.mktemp("cache-a")))


def _keys(path: Path) -> list[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return list(f.keys())


def test_two_builds_in_two_caches_give_identical_bytes(model_dir, tmp_path):
    other = Path(random_model_path(tmp_path))
    assert other.name == model_dir.name and other.parent != model_dir.parent
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (other / name).read_bytes() == (model_dir / name).read_bytes(), name
    assert [p.name for p in tmp_path.iterdir()] == [other.name]  # no temp dir left behind


def test_default_model_path_is_the_random_build_until_weights_ship(model_dir, monkeypatch):
    monkeypatch.setattr(default_model, "FILES_DIR", model_dir.parent / "no-shipped-weights")
    monkeypatch.setenv("DELTASERVE_CACHE", str(model_dir.parent))
    assert default_model_path() == str(model_dir)
    monkeypatch.delenv("DELTASERVE_CACHE")
    assert default_model_path(model_dir.parent) == str(model_dir)
    monkeypatch.setattr(default_model, "FILES_DIR", model_dir)  # a folder with weights "ships"
    assert default_model.shipped_model_path() == default_model_path() == str(model_dir)


def test_a_builder_that_loses_the_race_keeps_the_winners_folder(tmp_path, monkeypatch):
    final = tmp_path / f"default-{build.builder_key()[:16]}"

    def racing_write(folder):
        final.mkdir()
        (final / "model.safetensors").write_bytes(b"winner")  # the other process finished first
        (Path(folder) / "model.safetensors").write_bytes(b"loser")

    monkeypatch.setattr(build, "write_random_model", racing_write)
    assert random_model_path(tmp_path) == str(final)
    assert (final / "model.safetensors").read_bytes() == b"winner"
    assert [p.name for p in tmp_path.iterdir()] == [final.name]


def test_config_is_a_hybrid_qwen3_5_text_with_one_mtp_layer(model_dir):
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_5_text" and cfg["vocab_size"] == 8192
    assert cfg["layer_types"] == (["linear_attention"] * 3 + ["full_attention"]) * 2
    assert cfg["mtp_num_hidden_layers"] == 1 and cfg["tie_word_embeddings"] is True
    assert cfg["eos_token_id"] == 0 and cfg["max_position_embeddings"] == 32768
    assert cfg["rope_parameters"]["partial_rotary_factor"] == 0.25


def test_mtp_tensors_mirror_a_full_attention_layer(model_dir):
    keys = _keys(model_dir)
    layer3 = sorted(k[len("model.layers.3.") :] for k in keys if k.startswith("model.layers.3."))
    mtp_layer = sorted(k[len("mtp.layers.0.") :] for k in keys if k.startswith("mtp.layers.0."))
    assert mtp_layer == layer3 and "self_attn.q_proj.weight" in mtp_layer
    assert {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight",
            "mtp.norm.weight"} <= set(keys)
    assert "lm_head.weight" not in keys  # tied
    with safe_open(model_dir / "model.safetensors", "pt") as f:
        hidden = json.loads((model_dir / "config.json").read_text())["hidden_size"]
        assert f.get_slice("mtp.fc.weight").get_shape() == [hidden, 2 * hidden]
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.bfloat16


def test_transformers_loads_it_offline_and_generates(model_dir):
    from transformers import AutoConfig, AutoTokenizer, Qwen3_5ForCausalLM

    assert AutoConfig.from_pretrained(model_dir, local_files_only=True).model_type == "qwen3_5_text"
    tok = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    model = Qwen3_5ForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, local_files_only=True
    ).eval()
    ids = tok("def add(a, b):\n", return_tensors="pt").input_ids
    with torch.no_grad(), torch_gdn_reference():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
    assert torch.isfinite(logits).all()
    top2 = logits[0, -1].topk(2).values
    assert top2[0] - top2[1] > 1e-3  # not a degenerate near-uniform model
    new = out[0, ids.shape[1]:].tolist()
    assert len(new) == 6 and new[0] == int(logits[0, -1].argmax())
