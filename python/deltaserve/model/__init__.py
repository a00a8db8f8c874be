"""Model definitions: config, layers (GDN, gated attention, MLP/MoE, norms, RoPE), the hybrid
causal LM, its MTP head, and weight loading. See docs/interfaces.md (model/)."""

from deltaserve.model.config import SUPPORTED_MODEL_TYPES, ModelConfig
from deltaserve.model.loader import load_model
from deltaserve.model.mtp import MTPHead
from deltaserve.model.qwen3_5 import Model

__all__ = ["SUPPORTED_MODEL_TYPES", "MTPHead", "Model", "ModelConfig", "load_model"]
