"""Helpers for the server tests: the tiny model, the real engine, a live uvicorn server.

uvicorn runs in a background thread on a socket bound to port 0 (a free port picked by the
OS) and is shut down by `LiveServer.stop()`.
"""

from __future__ import annotations

import json
import shutil
import socket
import threading
import time
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import uvicorn

from deltaserve.server.async_engine import AsyncEngine

MAX_MODEL_LEN = 512
API_KEY = "sk-deltaserve-test-key"  # the `keyed` server's --api-key


class FlakyEngine:
    """The engine under test, with a switch that makes the next `step()` raise (tests the 500
    path without breaking the real engine: the failure happens before its step runs)."""

    def __init__(self, engine) -> None:
        self._engine = engine
        self.fail_next_step = False

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def step(self):
        if self.fail_next_step:
            self.fail_next_step = False
            raise RuntimeError("injected step failure")
        return self._engine.step()


def make_tiny_model(folder: Path) -> Path:
    """A tiny random qwen3_5_text checkpoint that speaks the default model's tokenizer."""
    from deltaserve.model.testing import make_tiny_checkpoint

    tokenizer_files = resources.files("deltaserve.default_model") / "files"
    vocab = json.loads((tokenizer_files / "tokenizer.json").read_text())["model"]["vocab"]
    path = make_tiny_checkpoint(folder, "qwen3_5_text", seed=0, vocab_size=len(vocab))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(str(tokenizer_files / name), path / name)
    return path


def make_engine(model: Path):
    """The real engine on the tiny model: CPU, fp32, a small context and page pool."""
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=str(model), device="cpu", dtype="float32",
                                  max_model_len=MAX_MODEL_LEN, page_size=16, chunk_size=256,
                                  num_pages=160, max_running_reqs=4))


class LiveServer:
    """uvicorn serving `app` from a background thread on a free loopback port."""

    def __init__(self, app) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", lifespan="off", timeout_keep_alive=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]},
                                       name="uvicorn-test", daemon=True)

    def start(self, timeout: float = 20.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            assert self.thread.is_alive(), "uvicorn exited during startup"
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn did not shut down"


@dataclass
class Served:
    base_url: str
    engine: AsyncEngine
    flaky: FlakyEngine
    model: str
