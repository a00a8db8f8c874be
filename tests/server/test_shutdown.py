"""Ctrl-C on `deltaserve serve`: requests still running when the engine stops get an answer
(a 503 JSON error, or an error event then [DONE] in a stream), not a cancelled task."""

from __future__ import annotations

import logging
import signal
import socket
import threading
import time

import httpx
import uvicorn
from live_server import make_engine

from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.cli import graceful_server


class SlowEngine:
    """The real engine, 20 ms per step: a 400-token request outlives the shutdown."""

    def __init__(self, engine) -> None:
        self._engine = engine

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        time.sleep(0.02)
        return self._engine.step()


def test_requests_running_at_shutdown_end_with_a_503_or_an_error_event(tiny_model, caplog):
    engine = AsyncEngine(SlowEngine(make_engine(tiny_model)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(build_app(engine), log_level="warning", timeout_graceful_shutdown=5)
    server = graceful_server(config, engine, stop_after=0.3)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    body = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "temperature": 0}
    results: dict = {}

    def plain() -> None:
        results["plain"] = httpx.post(base + "/v1/completions", json=body, timeout=30)

    def streamed() -> None:
        with httpx.stream("POST", base + "/v1/completions", json={**body, "stream": True},
                          timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        clients = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for c in clients:
            c.start()
        while engine.num_inflight < 2:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.02)
        with caplog.at_level(logging.INFO):
            server.handle_exit(signal.SIGINT, None)
            for c in clients:
                c.join(10)
            thread.join(10)
        assert not thread.is_alive(), "the server did not stop"
        plain_response = results["plain"]
        assert plain_response.status_code == 503
        assert plain_response.json()["error"]["message"] == "the engine was shut down"
        events = results["stream"]
        assert events[-1] == "data: [DONE]"
        assert "the engine was shut down" in events[-2]
        assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    finally:
        server.should_exit = True
        engine.shutdown()
