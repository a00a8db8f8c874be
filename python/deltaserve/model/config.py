"""ModelConfig: the text model's dimensions, parsed from a checkpoint's `config.json`.

Covers the `config.json` model types in `SUPPORTED_MODEL_TYPES`. The multimodal wrappers
(`qwen3_5`, `qwen3_5_moe`) keep the language model in `text_config`; only that part is used.
Defaults follow transformers' `Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig` and `Qwen3NextConfig`
(transformers/models/*/configuration_*.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

# config.json model_type -> family. "qwen3_5": dense Qwen3.5/3.6, "qwen3_5_moe": Qwen3.5/3.6 MoE,
# "qwen3_next": Qwen3-Next (fused, per-key-head interleaved GDN input projections).
SUPPORTED_MODEL_TYPES: dict[str, str] = {
    "qwen3_5_text": "qwen3_5",
    "qwen3_5": "qwen3_5",
    "qwen3_5_moe_text": "qwen3_5_moe",
    "qwen3_5_moe": "qwen3_5_moe",
    "qwen3_next": "qwen3_next",
}
FULL_ATTENTION = "full_attention"
LINEAR_ATTENTION = "linear_attention"


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of one hybrid GDN + attention text model.

    Layer `i` is a GDN layer when `layer_types[i] == "linear_attention"`, a gated full-attention
    layer when it is `"full_attention"`. `num_experts == 0` means every MLP is dense.
    """

    model_type: str  # config.json's top-level model_type
    family: str  # qwen3_5 | qwen3_5_moe | qwen3_next
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None  # text-only serving uses plain 1-D positions
    mrope_interleaved: bool
    # GDN
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MLP / MoE
    hidden_act: str
    intermediate_size: int
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    decoder_sparse_step: int
    mlp_only_layers: tuple[int, ...]
    # misc
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]  # config.json's, then generation_config.json's
    mtp_num_hidden_layers: int
    torch_dtype: str | None  # the checkpoint's dtype as config.json names it

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        """Read `path/config.json` (and `generation_config.json` for extra EOS ids, if present).

        Raises ValueError for an unknown model type (listing the supported ones), a non-SiLU
        activation, an unsupported RoPE type, or a config.json that is not JSON, not an object
        or lacks a field (naming the file); FileNotFoundError if config.json is missing.
        """
        path = Path(path)
        config_file = path / "config.json"
        if path.exists() and not path.is_dir():
            raise FileNotFoundError(f"{path} is a file, not a checkpoint folder (one that "
                                    "holds config.json and the weights)")
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        raw = _read_json(config_file)
        gen_file = path / "generation_config.json"
        gen = _read_json(gen_file) if gen_file.is_file() else {}
        try:
            return cls.from_dict(raw, generation_config=gen)
        except (TypeError, KeyError, AttributeError) as e:  # a field missing or of a wrong type
            raise ValueError(f"{config_file}: a field is missing or malformed ({type(e).__name__}"
                             f": {e})") from e

    @classmethod
    def from_dict(cls, raw: dict[str, Any],
                  generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Parse a config.json dict (see `from_pretrained`)."""
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            supported = ", ".join(SUPPORTED_MODEL_TYPES)
            raise ValueError(f"unsupported model type {model_type!r}; supported: {supported}")
        family = SUPPORTED_MODEL_TYPES[model_type]
        text = raw.get("text_config") if model_type in ("qwen3_5", "qwen3_5_moe") else raw
        if text is None:
            raise ValueError(f"config.json of model type {model_type!r} has no text_config")

        def get(key: str, default: Any = None) -> Any:
            # The text part wins; wrapper-level keys (tie_word_embeddings, eos) fill gaps.
            if key in text and text[key] is not None:
                return text[key]
            return raw.get(key, default) if raw.get(key) is not None else default

        hidden_act = get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu is implemented")
        num_layers = int(get("num_hidden_layers"))
        layer_types = get("layer_types")
        if layer_types is None:  # transformers: every `interval`-th layer is full attention
            interval = int(get("full_attention_interval", 4))
            layer_types = [FULL_ATTENTION if (i + 1) % interval == 0 else LINEAR_ATTENTION
                           for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - {FULL_ATTENTION, LINEAR_ATTENTION}:
            raise ValueError(f"bad layer_types {layer_types!r} for {num_layers} layers")

        rope = dict(get("rope_parameters") or get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"unsupported rope_type {rope_type!r}; only default RoPE is "
                             "implemented")
        rope_theta = rope.get("rope_theta", get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
        mrope = rope.get("mrope_section")

        hidden = int(get("hidden_size"))
        heads = int(get("num_attention_heads"))
        num_experts = int(get("num_experts", 0) or 0) if family != "qwen3_5" else 0
        eos: list[int] = []
        for source in (get("eos_token_id"), (generation_config or {}).get("eos_token_id")):
            for tok in [source] if isinstance(source, int) else (source or []):
                if tok not in eos:
                    eos.append(int(tok))
        return cls(
            model_type=model_type,
            family=family,
            vocab_size=int(get("vocab_size")),
            hidden_size=hidden,
            num_hidden_layers=num_layers,
            layer_types=tuple(layer_types),
            num_attention_heads=heads,
            num_key_value_heads=int(get("num_key_value_heads", heads)),
            head_dim=int(get("head_dim") or hidden // heads),
            attention_bias=bool(get("attention_bias", False)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            mrope_section=tuple(mrope) if mrope else None,
            mrope_interleaved=bool(rope.get("mrope_interleaved", False)),
            linear_num_key_heads=int(get("linear_num_key_heads", 16)),
            linear_num_value_heads=int(get("linear_num_value_heads", 32)),
            linear_key_head_dim=int(get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
            hidden_act=hidden_act,
            intermediate_size=int(get("intermediate_size", 0) or 0),
            num_experts=num_experts,
            num_experts_per_tok=int(get("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(get("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 0) or 0),
            # Qwen3.5-MoE's router always renormalises its top-k (no config field).
            norm_topk_prob=bool(get("norm_topk_prob", True)),
            decoder_sparse_step=int(get("decoder_sparse_step", 1) or 1),
            mlp_only_layers=tuple(get("mlp_only_layers") or ()),
            rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings",
                                             text.get("tie_word_embeddings", False))),
            max_position_embeddings=int(get("max_position_embeddings", 32768)),
            eos_token_ids=tuple(eos),
            mtp_num_hidden_layers=int(get("mtp_num_hidden_layers", 0) or 0),
            torch_dtype=get("dtype") or get("torch_dtype"),
        )

    # ---- derived values -------------------------------------------------------------------
    @property
    def fused_gdn_projections(self) -> bool:
        """Qwen3-Next stores in_proj_qkvz / in_proj_ba (per key head interleaved)."""
        return self.family == "qwen3_next"

    @property
    def eos_token_id(self) -> list[int]:
        """`eos_token_ids` as a list (the transformers field name)."""
        return list(self.eos_token_ids)

    @property
    def conv_dim(self) -> int:
        """D = 2·H·K + HV·V: channels of the GDN conv1d (q, k, v concatenated)."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    @property
    def rotary_dim(self) -> int:
        """Leading channels of each attention head that RoPE rotates."""
        return int(self.head_dim * self.partial_rotary_factor)

    @cached_property
    def gdn_layer_ids(self) -> tuple[int, ...]:
        """Decoder-layer indices of the GDN layers, in gdn_id order."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == LINEAR_ATTENTION)

    @cached_property
    def attention_layer_ids(self) -> tuple[int, ...]:
        """Decoder-layer indices of the full-attention layers (their attention `layer_id`s)."""
        return tuple(i for i, t in enumerate(self.layer_types) if t == FULL_ATTENTION)

    @cached_property
    def gdn_index(self) -> dict[int, int]:
        """Decoder-layer index -> gdn_id (index into the GDN state pool's layer axis)."""
        return {layer: gid for gid, layer in enumerate(self.gdn_layer_ids)}

    @property
    def num_gdn_layers(self) -> int:
        return len(self.gdn_layer_ids)

    @property
    def num_attention_layers(self) -> int:
        return len(self.attention_layer_ids)

    @property
    def mtp_layer_ids(self) -> tuple[int, ...]:
        """Attention `layer_id`s of the MTP layers: num_hidden_layers + step."""
        return tuple(self.num_hidden_layers + i for i in range(self.mtp_num_hidden_layers))

    def is_moe_layer(self, layer_idx: int) -> bool:
        """transformers' Qwen3NextDecoderLayer rule (Qwen3.5-MoE: every layer; dense: none)."""
        return (self.num_experts > 0 and layer_idx not in self.mlp_only_layers
                and (layer_idx + 1) % self.decoder_sparse_step == 0)


def _read_json(file: Path) -> dict[str, Any]:
    """A JSON object from `file`; ValueError naming the file when it is not one."""
    try:
        raw = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(raw, dict):
        raise ValueError(f"{file}: must hold a JSON object, not {type(raw).__name__}")
    return raw
