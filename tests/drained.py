"""The leak check every engine-level test ends with."""

from __future__ import annotations


def assert_drained(engine) -> None:
    """After all requests ended: the cache is consistent, and once flushed every page, every
    GDN state slot and every host-bank slot is free again (nothing leaked, nothing owned
    twice), and no request still holds snapshot slots."""
    engine.check_integrity()  # the cache's own checks and: everything allocated is the cache's
    engine.flush_cache()
    status = engine.cache_status()
    assert status["running_requests"] == status["waiting_requests"] == 0
    assert status["pages_free"] == status["pages_total"]
    assert status["slots_free"] == status["slots_total"]
    assert status["host_slots_used"] == 0
    assert not engine.scheduler.snaps.tracks and not engine.scheduler.snaps.chunk
