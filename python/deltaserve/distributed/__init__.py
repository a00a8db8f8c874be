"""Tensor parallelism (`--tensor-parallel-size N`): the model sharded over N processes.

shard.py cuts the one model definition down to a rank's shard; layers.py holds the ops with
collectives; group.py the process group; worker.py the worker processes and their control
channel; engine.py `TPEngine`, the engine over them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine


def create_engine(cfg: EngineConfig) -> LLMEngine:
    """LLMEngine for tensor_parallel_size 1 (no process, no collective), else TPEngine (rank 0,
    spawning the other ranks)."""
    if cfg.tensor_parallel_size > 1:
        from deltaserve.distributed.engine import TPEngine

        return TPEngine(cfg)
    from deltaserve.engine.llm_engine import LLMEngine

    return LLMEngine(cfg)
