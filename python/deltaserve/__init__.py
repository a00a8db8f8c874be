"""deltaserve: a serving engine for hybrid Gated DeltaNet + attention models.

`from deltaserve import LLM, SamplingParams` (imported lazily so `import deltaserve` stays cheap).
"""

from __future__ import annotations

__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name: str):
    if name == "LLM":
        from deltaserve.llm import LLM

        return LLM
    if name == "SamplingParams":
        from deltaserve.core import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from deltaserve.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
