"""Fixtures of the server tests: one real engine and one live loopback server per session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from live_server import API_KEY, FlakyEngine, LiveServer, Served, make_engine, make_tiny_model

from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.security import ServerOptions


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("server") / "tiny")


@pytest.fixture(scope="session")
def served(tiny_model: Path) -> Iterator[Served]:
    flaky = FlakyEngine(make_engine(tiny_model))
    engine = AsyncEngine(flaky)
    server = LiveServer(build_app(engine))
    server.start()
    try:
        yield Served(server.base_url, engine, flaky, engine.model_name)
    finally:
        server.stop()
        engine.shutdown()


@pytest.fixture
def client(served: Served) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        yield c


@pytest.fixture(scope="session")
def keyed(served: Served) -> Iterator[str]:
    """The base URL of a second live server on the same engine, with --api-key API_KEY and
    bound to loopback (so it accepts loopback Host names only)."""
    server = LiveServer(build_app(served.engine, ServerOptions.for_bind("127.0.0.1",
                                                                        api_key=API_KEY)))
    server.start()
    try:
        yield server.base_url
    finally:
        server.stop()
