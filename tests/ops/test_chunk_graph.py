"""ops/chunk_graph.py on any machine: the DS_PREFILL_GRAPH_TOKENS switch and the CPU path,
which never replays (the replays themselves: tests/ops/test_gdn_prefill_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from deltaserve.ops import chunk_graph


def test_the_switch_defaults_to_2048_tokens_and_0_turns_it_off(monkeypatch):
    monkeypatch.delenv("DS_PREFILL_GRAPH_TOKENS", raising=False)
    assert chunk_graph.max_tokens() == 2048
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "4096")
    assert chunk_graph.max_tokens() == 4096
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "0")
    assert not chunk_graph.eligible(256, torch.zeros(1, device="meta"))


@pytest.mark.parametrize("value", ["-1", "lots", "2.5", str((1 << 20) + 1)])
def test_a_bad_switch_value_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", value)
    with pytest.raises(ValueError, match="DS_PREFILL_GRAPH_TOKENS"):
        chunk_graph.max_tokens()


def test_cpu_tensors_never_replay(monkeypatch):
    monkeypatch.setenv("DS_PREFILL_GRAPH_TOKENS", "4096")
    assert not chunk_graph.eligible(256, torch.zeros(1))


class _Graph:
    """Stands in for a captured CUDA graph: replay runs the recorded function again."""

    def __init__(self, fn, inputs):
        self.fn, self.inputs, self.out = fn, inputs, None

    def replay(self):
        self.out = self.fn(*self.inputs)


@pytest.fixture
def fake_capture(monkeypatch):
    """ReplayedCall on CPU tensors, its capture recorded (and failed on demand) instead of
    made: what runs eagerly and what is captured at which call."""
    log = {"eager": 0, "captures": [], "fail": False}
    monkeypatch.setattr(chunk_graph, "_state", {"failed": False, "warm": True})
    monkeypatch.setattr(chunk_graph, "_warmed", set())

    def capture(self, first=False):
        log["captures"].append((self.calls, first))
        if log["fail"]:
            return chunk_graph._capture_failed(first, RuntimeError("a capture may not compile"))
        self.graph = _Graph(self.fn, self.static)
        self.outputs = (self.static[0] * 0,)  # replaced per replay below
        return True

    monkeypatch.setattr(chunk_graph.ReplayedCall, "_capture", capture)

    def fn(x):
        log["eager"] += 1
        return (x * 2,)

    return log, fn


def _forward(fn, warm_key, layers=3):
    cache = {}
    for i in range(layers):
        chunk_graph.replayed(cache, ("k",), lambda: fn, (torch.full((2,), float(i)),), warm_key)
    return cache[("k",)]


def test_a_forward_of_an_unwarmed_class_runs_its_first_call_eagerly(fake_capture):
    log, fn = fake_capture
    call = _forward(fn, ("class",))
    assert log["captures"] == [(2, False)] and ("class",) in chunk_graph._warmed
    assert call.calls == 3


def test_once_its_class_ran_eagerly_a_forward_captures_at_its_first_call(fake_capture):
    log, fn = fake_capture
    _forward(fn, ("class",))
    log["captures"].clear()
    _forward(fn, ("class",))
    assert log["captures"] == [(1, True)]
    _forward(fn, ("other",))  # another class: eager first again
    assert log["captures"] == [(1, True), (2, False)]
    _forward(fn, None)  # no class: never warmed
    assert log["captures"] == [(1, True), (2, False), (2, False)]


def test_a_failed_capture_at_a_first_call_stops_only_first_call_captures(fake_capture):
    log, fn = fake_capture
    _forward(fn, ("class",))
    log["captures"].clear()
    log["fail"] = True
    _forward(fn, ("class",), layers=1)
    assert log["captures"] == [(1, True)] and chunk_graph._state == {"failed": False,
                                                                     "warm": False}
    log["fail"] = False
    _forward(fn, ("class",))  # eager first again, then capture: replays stay on
    assert log["captures"][1:] == [(2, False)]
