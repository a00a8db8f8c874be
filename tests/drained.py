"""The leak check every engine-level test ends with."""

from __future__ import annotations


def assert_drained(engine) -> None:
    """After all requests ended: the cache is consistent, and once flushed every page and
    every GDN state slot is free again (nothing leaked, nothing owned twice)."""
    engine.prefix_cache.check_integrity()
    engine.flush_cache()
    status = engine.cache_status()
    assert status["running_requests"] == status["waiting_requests"] == 0
    assert status["pages_free"] == status["pages_total"]
    assert status["slots_free"] == status["slots_total"]
