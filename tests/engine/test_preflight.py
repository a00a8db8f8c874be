"""The checks of engine/preflight.py: the cache plan is what build_caches allocates, and a
config whose caches cannot fit (or whose pool holds no request) is refused before the weights
load."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.preflight import CachePlan, memory_refusal, model_config, plan_caches
from deltaserve.model.testing import make_tiny_checkpoint

GIB = 2**30


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_checkpoint(tmp_path_factory.mktemp("preflight") / "m", "qwen3_5_text",
                                    seed=0))


class NoWeights(LLMEngine):
    """An engine that must be refused before it loads any weight."""

    def _load_model(self, path: str):
        raise AssertionError("the weights were loaded before the config was checked")


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("fields", [
    {"num_pages": 40},
    {"kv_memory_gb": 0.001, "max_running_reqs": 3, "num_snapshot_slots": 5},
    {"num_pages": 33, "speculative_algorithm": "mtp", "host_snapshot_slots": 6, "dtype":
     "bfloat16"},
], ids=["pages", "budget", "mtp + host bank"])
def test_the_plan_is_what_the_engine_allocates(tiny, fields):
    cfg = EngineConfig(model=tiny, device="cpu", max_model_len=256,
                       **{"dtype": "float32", **fields})
    engine = LLMEngine(dataclasses.replace(cfg))
    cfg.resolve_speculation()
    plan = plan_caches(cfg, model_config(cfg), engine.max_model_len, engine.dtype)
    kv = nbytes(engine.kv.k, engine.kv.v)
    if engine.draft_kv is not None:
        kv += nbytes(engine.draft_kv.k, engine.draft_kv.v)
    pool = engine.state_pool
    assert plan.kv_bytes == kv and plan.n_pages == engine.page_pool.num_pages
    assert plan.state_bytes == nbytes(pool.recurrent, pool.conv)
    assert plan.n_state_slots == pool.num_slots
    bank = engine.host_bank
    assert plan.host_bytes == (0 if bank is None else bank.bytes_per_slot * bank.num_slots)
    assert plan.longest_request == engine.scheduler.max_request_len()


@pytest.mark.parametrize("fields, says", [
    ({"num_pages": 10**11}, "the caches do not fit in memory: they alone need"),
    ({"max_running_reqs": 10**9}, "1 + 2 x --max-running-reqs 1000000000"),
    ({"host_snapshot_slots": 10**10}, "10000000000 host snapshot slots"),
    ({"num_pages": 2, "page_size": 1}, "num_pages: the KV page pool cannot hold even a "
                                       "2-token request (1 tokens fit)"),
    ({"max_model_len": 10**9}, "max_model_len 1000000000 exceeds the model's"),
])
def test_a_config_that_cannot_run_is_refused_before_the_weights_load(tiny, fields, says):
    with pytest.raises(ValueError) as e:
        NoWeights(EngineConfig(model=tiny, device="cpu", dtype="float32", **fields))
    assert says in str(e.value)


def plan(kv: int, state: int, host: int) -> CachePlan:
    return CachePlan(n_pages=9, n_snapshot_slots=2, n_state_slots=7, n_host_slots=3,
                     kv_bytes=kv, state_bytes=state, host_bytes=host, longest_request=100)


def test_on_a_cpu_every_cache_counts_against_the_machines_memory():
    cfg = EngineConfig(device="cpu", tensor_parallel_size=2)
    cpu = torch.device("cpu")
    assert memory_refusal(plan(5 * GIB, 2 * GIB, 1 * GIB), cfg, cpu, 8 * GIB) is None
    refusal = memory_refusal(plan(5 * GIB, 2 * GIB, 1 * GIB + 1), cfg, cpu, 8 * GIB)
    assert refusal.startswith("the caches do not fit in memory: they alone need 8.00 GiB, "
                              "more than this machine's 8.00 GiB of memory: 9 KV pages")
    assert refusal.endswith("lower --max-running-reqs, --num-pages / --kv-memory-gb, "
                            "--num-snapshot-slots or --host-snapshot-slots")
    assert memory_refusal(plan(10**18, 0, 0), cfg, cpu, None) is None  # memory unknown
