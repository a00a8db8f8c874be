"""What an LLMEngine reports about itself: the step log line, /v1/cache/status, /metrics.

Functions of the engine (`engine` is the LLMEngine) kept beside it so engine/llm_engine.py holds
the stepping alone.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from deltaserve.core import Phase

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import LLMEngine

logger = logging.getLogger("deltaserve.engine")


def log_step(engine: LLMEngine, batch) -> None:
    """One step log line every cfg.log_every steps (--log-every): batch kind, drafts k, rows,
    cached tokens, pages, device and host slots, fork snapshots, queue lengths."""
    every = engine.cfg.log_every
    if not every or engine.num_steps % every:
        return
    new = batch.num_tokens
    cached = sum(r.cached_len for r in batch.reqs) if batch.phase is Phase.PREFILL else 0
    pool, host = engine.page_pool, engine.prefix_cache.host_usage()
    logger.info(
        "step %d %s batch: #req %d, k %d, #new-token %d, #cached-token %d, pages %d/%d "
        "used, #slots %d/%d used on device, #host-slots %d/%d used, #fork-snapshots %d, "
        "running %d, waiting %d",
        engine.num_steps, batch.phase.value, batch.size,
        batch.rows_per_req - 1 if batch.phase is not Phase.PREFILL else 0, new, cached,
        pool.num_pages - 1 - pool.num_free, pool.num_pages - 1,
        engine.state_pool.num_slots - 1 - engine.state_pool.num_free,
        engine.state_pool.num_slots - 1, host.n_used, host.n_slots,
        engine.scheduler.snaps.n_forks, len(engine.scheduler.running),
        len(engine.scheduler.waiting))


def cache_status(engine: LLMEngine) -> dict:
    """Pools and prefix cache now: pages, device slots, host-bank slots and bytes (all 0
    without a bank), snapshots taken at prefill chunk ends and at forks from a cached
    path, queue lengths, hit tokens."""
    pool, sp = engine.page_pool, engine.state_pool
    stats, host = engine.prefix_cache.stats(), engine.prefix_cache.host_usage()
    snaps = engine.scheduler.snaps
    return {
        "page_size": engine.cfg.page_size,
        "pages_total": pool.num_pages - 1,
        "pages_free": pool.num_free,
        "pages_cached": stats.n_pages,
        "pages_reserved": engine.scheduler.reserved_pages(),  # promised to running requests
        "slots_total": sp.num_slots - 1,
        "slots_free": sp.num_free,
        "slots_snapshot": stats.n_snapshots,
        "slot_bytes": sp.bytes_per_slot,
        "host_slots_total": host.n_slots,
        "host_slots_used": host.n_used,
        "host_slots_snapshot": stats.n_host_snapshots,
        "host_bytes_total": host.bytes_total,
        "host_bytes_used": host.bytes_used,
        "chunk_snapshots_taken": snaps.n_taken,
        "chunk_snapshots_skipped": snaps.n_skipped,
        "chunk_snapshots_to_host": snaps.n_to_host,
        "fork_snapshots_taken": snaps.n_forks,  # where a prompt left a cached path
        "fork_snapshots_skipped": snaps.n_forks_skipped,  # no slot on either tier
        "running_requests": len(engine.scheduler.running),
        "waiting_requests": len(engine.scheduler.waiting),
        "hit_tokens": engine.scheduler.hit_tokens,
        "prompt_tokens": engine.scheduler.prompt_tokens,
    }


def spec_status(engine: LLMEngine) -> dict | None:
    """Speculative decoding's counters since start (None with speculation off): verify steps,
    requests' verifies (one per request a step: vLLM's "drafts"), the draft tokens they
    checked and those accepted (committed rows less one a verify)."""
    if engine.spec is None:
        return None
    return {"verify_steps": engine.spec_verify_steps, "drafts": engine.spec_steps,
            "draft_tokens": engine.spec_drafted,
            "accepted_tokens": engine.spec_committed - engine.spec_steps}


def engine_metrics(engine: LLMEngine) -> dict[str, float]:
    """num_steps, generated / prompt / cached tokens, queue lengths, pages and slots used."""
    status = cache_status(engine)
    return {
        "num_steps": float(engine.num_steps),
        "generated_tokens": float(engine.generated_tokens),
        "prompt_tokens": float(status["prompt_tokens"]),
        "cached_tokens": float(status["hit_tokens"]),
        "running_requests": float(status["running_requests"]),
        "waiting_requests": float(status["waiting_requests"]),
        "pages_used": float(status["pages_total"] - status["pages_free"]),
        "slots_used": float(status["slots_total"] - status["slots_free"]),
        "host_slots_used": float(status["host_slots_used"]),
    }


def check_integrity(engine: LLMEngine) -> None:
    """The prefix cache's and the pools' own checks and, when no request is left, that
    every allocated page, GDN state slot and host-bank slot is owned by the cache (so
    nothing leaked). Raises AssertionError naming what is wrong. O(cache size)."""
    engine.prefix_cache.check_integrity()
    if engine.scheduler.has_unfinished():
        return
    tree, bank = engine.prefix_cache.tree, engine.prefix_cache.host_bank
    assert engine.page_pool.num_allocated == len(tree.pages), (
        f"{engine.page_pool.num_allocated - len(tree.pages)} KV pages leaked")
    assert engine.state_pool.num_allocated == len(tree.slots), (
        f"{engine.state_pool.num_allocated - len(tree.slots)} GDN state slots leaked")
    if bank is not None:
        assert bank.num_allocated == len(tree.host_slots), (
            f"{bank.num_allocated - len(tree.host_slots)} host snapshot slots leaked")
    snaps = engine.scheduler.snaps
    assert not snaps.tracks and not snaps.chunk, "snapshot slots of finished requests held"
