"""Ctrl-C or SIGTERM on `deltaserve serve`: requests still running when the server stops get
an answer (a 503 JSON error, or an error event then [DONE] in a stream), not a cancelled
task: after the engine stops (first signal), on a second signal (force quit) and when
uvicorn's grace period runs out."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import uvicorn
from live_server import make_engine
from slow_server import SlowEngine

from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.server.shutdown import CANCELLED_MESSAGE, graceful_server

BODY = {"prompt": "Hi", "max_tokens": 400, "ignore_eos": True, "temperature": 0}


def stop_mid_requests(tiny_model, caplog, signals: int, stop_after: float, grace: float,
                      sig: int = signal.SIGINT) -> tuple[dict, AsyncEngine]:
    """Serve on a free port; start a plain, a streamed and an n=2 request; once all are
    running, deliver `signals` exit signals `sig`. Returns the answers (by kind) and the engine,
    shut down. uvicorn's own log records propagate (log_config=None) so that caplog sees
    its tracebacks too."""
    engine = AsyncEngine(SlowEngine(make_engine(tiny_model)))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    config = uvicorn.Config(build_app(engine), log_level="info", log_config=None,
                            timeout_graceful_shutdown=grace)
    server = graceful_server(config, engine, stop_after=stop_after)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    results: dict = {}

    def plain(kind: str, body: dict) -> None:
        results[kind] = httpx.post(base + "/v1/completions", json=body, timeout=30)

    def streamed() -> None:
        with httpx.stream("POST", base + "/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as r:
            results["stream"] = [line for line in r.iter_lines() if line.startswith("data: ")]

    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.02)
        clients = [threading.Thread(target=plain, args=("plain", BODY)),
                   threading.Thread(target=plain, args=("n2", {**BODY, "n": 2})),
                   threading.Thread(target=streamed)]
        for c in clients:
            c.start()
        while engine.num_inflight < 4:
            assert time.monotonic() < deadline, "the requests did not start"
            time.sleep(0.02)
        with caplog.at_level(logging.INFO):
            for _ in range(signals):
                server.handle_exit(sig, None)
                time.sleep(0.1)
            for c in clients:
                c.join(10)
            thread.join(10)
        assert not thread.is_alive(), "the server did not stop"
    finally:
        server.should_exit = True
        engine.shutdown()
    return results, engine


def assert_answered(results: dict, message: str, caplog) -> None:
    for kind in ("plain", "n2"):
        response = results[kind]
        assert response.status_code == 503, response.text
        assert response.json() == {"error": {"message": message, "type": "server_error",
                                             "param": None, "code": None}}
    events = results["stream"]
    assert events[-1] == "data: [DONE]"
    assert message in events[-2] and '"type":"server_error"' in events[-2]
    assert not [r for r in caplog.records if r.exc_info], "a traceback was logged"
    assert not [r for r in caplog.records if "Traceback" in r.getMessage()]


def assert_nothing_leaked(engine: AsyncEngine) -> None:
    assert engine.num_inflight == 0
    inner = engine.engine
    assert not inner.has_unfinished(), "a request is still in the engine"
    inner.flush_cache()
    inner.check_integrity()
    assert inner.page_pool.num_allocated == 0 and inner.state_pool.num_allocated == 0


def test_requests_running_at_shutdown_end_with_a_503_or_an_error_event(tiny_model, caplog):
    results, engine = stop_mid_requests(tiny_model, caplog, signals=1, stop_after=0.3, grace=5)
    assert_answered(results, "the engine was shut down", caplog)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("signals, grace, sig",
                         [(2, 60, signal.SIGINT), (2, 60, signal.SIGTERM),
                          (1, 0.3, signal.SIGINT)],
                         ids=["second Ctrl-C", "second SIGTERM",
                              "uvicorn's grace period runs out"])
def test_requests_cancelled_by_the_server_end_with_a_503_or_an_error_event(
        tiny_model, caplog, signals, grace, sig):
    """uvicorn cancels the request tasks (a plain-text 500 and an `Exception in ASGI
    application` traceback before LastResort); the engine is not stopped first. The second
    signal quits at once: the 60 s grace period would outlast the joins."""
    results, engine = stop_mid_requests(tiny_model, caplog, signals=signals, stop_after=30,
                                        grace=grace, sig=sig)
    assert_answered(results, CANCELLED_MESSAGE, caplog)
    assert_nothing_leaked(engine)


@pytest.mark.parametrize("first, second", [(signal.SIGTERM, signal.SIGTERM),
                                           (signal.SIGINT, signal.SIGTERM)],
                         ids=["SIGTERM twice", "Ctrl-C then SIGTERM"])
def test_a_force_quit_by_sigterm_answers_the_running_requests_before_the_process_ends(
        tiny_model, first, second):
    """Real signals to a server process (uvicorn catches them in the main thread only).
    uvicorn leaves the request tasks running on a force quit and re-raises the caught
    signals as it returns; SIGTERM's default action would then end the process before
    anything cancelled them (empty replies, streams cut without [DONE]) and in the middle of
    an engine step (a tensor-parallel worker then fails inside its collective)."""
    here = Path(__file__).parent
    child = subprocess.Popen([sys.executable, str(here / "slow_server.py"), str(tiny_model)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [str(here), os.environ.get("PYTHONPATH", "")])})
    results: dict = {}
    try:
        base = f"http://127.0.0.1:{child.stdout.readline().strip()}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert child.poll() is None and time.monotonic() < deadline, "no server"
            time.sleep(0.1)
        plain = threading.Thread(target=lambda: results.update(plain=httpx.post(
            base + "/v1/completions", json=BODY, timeout=30)))
        plain.start()
        with httpx.stream("POST", base + "/v1/completions", json={**BODY, "stream": True},
                          timeout=30) as r:
            lines = r.iter_lines()
            events = [next(line for line in lines if line.startswith("data: "))]
            while httpx.get(base + "/v1/cache/status").json()["running_requests"] < 2:
                assert time.monotonic() < deadline, "the plain request did not start"
                time.sleep(0.05)  # a request sent after the signal would be refused instead
            child.send_signal(first)
            time.sleep(0.3)
            child.send_signal(second)
            events += [line for line in lines if line.startswith("data: ")]
        plain.join(30)
        _, stderr = child.communicate(timeout=30)
    finally:
        child.kill()
    assert child.returncode == -signal.SIGTERM, stderr  # the re-raised signal ends it
    response = results["plain"]
    assert response.status_code == 503, response.text
    assert response.json()["error"]["message"] == CANCELLED_MESSAGE
    assert events[-1] == "data: [DONE]"
    assert CANCELLED_MESSAGE in events[-2], events[-2:]
    assert "Traceback" not in stderr, stderr
    assert "engine thread stopped" in stderr, stderr  # not cut off inside a step
