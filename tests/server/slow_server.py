"""A server on the tiny model whose engine takes 20 ms a step, run as `python slow_server.py
MODEL` in a process of its own: uvicorn handles signals in the main thread only, so the
shutdown tests that send real signals need one. Prints the port, then serves until a signal
ends it the way `deltaserve serve` does (uvicorn re-raises the signals it caught)."""

from __future__ import annotations

import logging
import socket
import sys
import time
from pathlib import Path

import uvicorn
from live_server import make_engine

from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.shutdown import graceful_server


class SlowEngine:
    """The real engine, 20 ms per step: a 400-token request outlives the shutdown."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(0.02)
        return self._engine.step()


def main(model: str) -> None:
    logging.basicConfig(level=logging.INFO)  # the engine's "engine thread stopped" included
    engine = AsyncEngine(SlowEngine(make_engine(Path(model))))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    # the engine is stopped only after 30 s and uvicorn's grace period is 60 s: a request
    # answered before either ends was answered by the force quit
    config = uvicorn.Config(build_app(engine), log_level="info",
                            timeout_graceful_shutdown=60)
    server = graceful_server(config, engine, stop_after=30)
    print(sock.getsockname()[1], flush=True)
    try:
        server.run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
