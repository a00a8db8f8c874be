"""`--load-format dummy`: random weights from config.json alone, deterministic in the seed."""

from __future__ import annotations

import shutil

import pytest
import torch
from model_helpers import Sequence

from deltaserve import LLM, SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.model.loader import load_model


@pytest.fixture(scope="module")
def config_only(tmp_path_factory):
    """A folder holding only the config.json of the tiny Qwen3.5-MoE checkpoint (one MTP layer)."""
    from deltaserve.model.testing import make_tiny_checkpoint

    full = make_tiny_checkpoint(tmp_path_factory.mktemp("full"), "qwen3_5_moe_text", seed=1)
    folder = tmp_path_factory.mktemp("config_only")
    shutil.copy(full / "config.json", folder / "config.json")
    return folder


def _flat(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_dummy_weights_need_only_config_json_and_follow_the_seed(config_only):
    a = load_model(config_only, torch.float32, load_format="dummy", seed=3)
    b = load_model(config_only, torch.float32, load_format="dummy", seed=3)
    c = load_model(config_only, torch.float32, load_format="dummy", seed=4)
    wa, wb, wc = _flat(a), _flat(b), _flat(c)
    assert a.mtp is not None  # the MTP layer the config announces is built
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    assert not any(torch.equal(wa[k], wc[k]) for k in wa if wa[k].numel() > 1)
    gate_up = wa["layers.0.mlp.experts.gate_up_proj"]
    assert abs(gate_up.std().item() - 0.02) < 0.002 and gate_up.mean().abs() < 0.002


def test_dummy_weights_give_finite_varied_logits_and_an_engine_serves_them(config_only):
    model = load_model(config_only, torch.float32, load_format="dummy", seed=2)
    logits = Sequence(model).feed(torch.arange(3, 40))
    assert logits.isfinite().all() and logits.std() > 0
    llm = LLM(str(config_only), load_format="dummy", device="cpu", num_pages=64, seed=2)
    (out,) = llm.generate([[5, 6, 7, 8]], SamplingParams(temperature=0.0, max_tokens=4,
                                                         ignore_eos=True))
    assert len(out.token_ids) == 4


def test_an_unknown_load_format_is_refused_naming_the_choices(config_only):
    with pytest.raises(ValueError, match="load_format must be one of auto, dummy"):
        load_model(config_only, torch.float32, load_format="safetensors")
    with pytest.raises(ValueError, match="load_format must be auto"):
        EngineConfig(load_format="pt").validate()
