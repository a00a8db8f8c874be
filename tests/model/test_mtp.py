"""MTPHead equals the same computation composed from transformers' modules on the mtp.* weights:
fc(concat[norm_e(embed(t_{i+1})), norm_h(h_i)]) -> full-attention decoder layer -> norm."""

from __future__ import annotations

import copy

import pytest
import torch
from model_helpers import Sequence, fuse_experts
from safetensors.torch import load_file
from torch import nn
from transformers import AutoConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import (
    Qwen3_5DecoderLayer,
    Qwen3_5RMSNorm,
    Qwen3_5TextRotaryEmbedding,
)
from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import (
    Qwen3_5MoeDecoderLayer,
    Qwen3_5MoeTextRotaryEmbedding,
)
from transformers.models.qwen3_next.modeling_qwen3_next import (
    Qwen3NextDecoderLayer,
    Qwen3NextRotaryEmbedding,
)

from deltaserve.model import load_model

ORACLE = {
    "qwen3_5_text": (Qwen3_5DecoderLayer, Qwen3_5TextRotaryEmbedding),
    "qwen3_5_moe": (Qwen3_5MoeDecoderLayer, Qwen3_5MoeTextRotaryEmbedding),
    "qwen3_next": (Qwen3NextDecoderLayer, Qwen3NextRotaryEmbedding),
}


@torch.no_grad()
def _transformers_mtp(path, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    layer_cls, rotary_cls = ORACLE[_family(path)]
    config = AutoConfig.from_pretrained(path).get_text_config()
    config._attn_implementation = "eager"
    ext = copy.deepcopy(config)
    ext.layer_types = [*config.layer_types, "full_attention"]
    ext.num_hidden_layers = config.num_hidden_layers + 1
    saved = load_file(path / "model.safetensors")
    mtp = {k.removeprefix("mtp."): v for k, v in saved.items() if k.startswith("mtp.")}
    fuse_experts(mtp)
    layer = layer_cls(ext, config.num_hidden_layers).eval()
    layer.load_state_dict({k.removeprefix("layers.0."): v for k, v in mtp.items()
                           if k.startswith("layers.0.")})
    h = config.hidden_size
    norms = {}
    for name in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        norms[name] = Qwen3_5RMSNorm(h, eps=config.rms_norm_eps)
        norms[name].weight.copy_(mtp[f"{name}.weight"])
    fc = nn.Linear(2 * h, h, bias=False)
    fc.weight.copy_(mtp["fc.weight"])
    embed = next(v for k, v in saved.items() if k.endswith("embed_tokens.weight"))

    x = fc(torch.cat([norms["pre_fc_norm_embedding"](embed[ids]),
                      norms["pre_fc_norm_hidden"](hidden)], dim=-1))[None]
    t = len(ids)
    positions = torch.arange(t)[None]
    if rotary_cls is not Qwen3NextRotaryEmbedding:  # mrope tables: one row per t/h/w section
        positions = positions[None].expand(3, 1, t)
    cos_sin = rotary_cls(ext)(x, positions)
    mask = torch.full((t, t), torch.finfo(x.dtype).min).triu(1)[None, None]
    y = layer(x, position_embeddings=cos_sin, attention_mask=mask)
    return norms["norm"](y)[0]


def _family(path) -> str:
    model_type = AutoConfig.from_pretrained(path).model_type
    return {"qwen3_5_moe_text": "qwen3_5_moe"}.get(model_type, model_type)


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "qwen3_5_moe", "qwen3_next"])
def test_mtp_head_matches_transformers_modules_on_the_mtp_weights(tiny_checkpoint, model_type):
    path = tiny_checkpoint(model_type)
    model = load_model(path, torch.float32, progress=False)
    ids = torch.randint(0, 512, (12,), generator=torch.Generator().manual_seed(4))
    seq = Sequence(model)
    hidden = model(ids, seq.context(12))  # the target's final hidden h_i
    next_ids = torch.roll(ids, -1)  # t_{i+1}
    draft = Sequence(model)
    got = model.mtp(next_ids, hidden, draft.context(12))
    want = _transformers_mtp(path, next_ids, hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the MTP layer attends through its own layer_id, after every target layer
    assert list(draft.attn.k) == [model.config.num_hidden_layers]
    assert model.compute_logits(got).shape == (12, model.config.vocab_size)
