"""A tensor-parallel server (TP 2, gloo) whose worker rank dies: the streamed request in
flight ends with an error event (no hang), /health answers 503 naming the rank, and a new
request gets an error response."""

from __future__ import annotations

import json
import os
import signal

import httpx
import pytest
from live_server import MAX_MODEL_LEN, LiveServer

from deltaserve.config import EngineConfig
from deltaserve.distributed.engine import TPEngine
from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine

GREEDY = {"temperature": 0, "ignore_eos": True}
pytestmark = pytest.mark.slow  # a worker process


def test_a_dead_rank_fails_the_stream_in_flight_and_health_reports_it(tiny_model):
    engine = TPEngine(EngineConfig(model=str(tiny_model), device="cpu", dtype="float32",
                                   max_model_len=MAX_MODEL_LEN, page_size=16, chunk_size=256,
                                   num_pages=160, max_running_reqs=4, tensor_parallel_size=2,
                                   distributed_timeout_s=20))
    async_engine = AsyncEngine(engine)
    server = LiveServer(build_app(async_engine))
    server.start()
    try:
        with httpx.Client(base_url=server.base_url, timeout=60) as c:
            ok = c.post("/v1/completions", json={"prompt": "def f(x):", "max_tokens": 4,
                                                 **GREEDY})
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4
            assert c.get("/health").status_code == 200
            request = {"prompt": "A long story", "max_tokens": MAX_MODEL_LEN - 32,
                       "stream": True, **GREEDY}
            with c.stream("POST", "/v1/completions", json=request) as r:
                lines = r.iter_lines()
                assert next(lines).startswith("data: ")
                os.kill(engine.workers.procs[0].pid, signal.SIGKILL)
                rest = [line for line in lines if line]
            assert rest[-1] == "data: [DONE]"
            error = json.loads(rest[-2][len("data: "):])["error"]
            assert error["type"] == "server_error" and "rank 1" in error["message"]
            health = c.get("/health")
            assert health.status_code == 503 and "rank 1" in health.json()["error"]["message"]
            again = c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **GREEDY})
            assert again.status_code >= 500 and again.json()["error"]["type"] == "server_error"
    finally:
        server.stop()
        async_engine.shutdown()
        engine.close()
