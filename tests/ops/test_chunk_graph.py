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
