"""The MTP proposer's cap on decode steps launched ahead between eager catch-ups
(spec/mtp/proposer.py ahead_cap): as large as AHEAD_CAP where the plain decode graphs'
hidden-state ring still fits RING_BYTES, lowered to fit it, never below MIN_AHEAD_CAP."""

from __future__ import annotations

import pytest

from deltaserve import LLM
from deltaserve.engine.cuda_graph import RING_BYTES, hidden_ring_steps
from deltaserve.model.testing import make_tiny_checkpoint
from deltaserve.spec.mtp import proposer

K = 3


def ring_steps(cap: int) -> int:
    """Steps of the ring that a cap asks for (hidden_ring_steps: held + 8, plus one)."""
    return cap + 2 * (K + 1) + 8 + 1


def test_a_small_step_keeps_ahead_cap():
    assert proposer.ahead_cap(64 * 384 * 2, K) == proposer.AHEAD_CAP


@pytest.mark.parametrize("step_bytes", [64 * 1024 * 2, 64 * 2048 * 2, 3 * 10 ** 5])
def test_a_large_step_lowers_the_cap_to_what_fits_the_ring(step_bytes):
    cap = proposer.ahead_cap(step_bytes, K)
    assert proposer.MIN_AHEAD_CAP <= cap < proposer.AHEAD_CAP
    assert ring_steps(cap) * step_bytes <= RING_BYTES < ring_steps(cap + 1) * step_bytes


def test_the_cap_stays_at_its_floor_where_no_ring_fits():
    assert proposer.ahead_cap(RING_BYTES, K) == proposer.MIN_AHEAD_CAP


def test_a_patched_ahead_cap_is_kept_below_the_floor(monkeypatch):
    monkeypatch.setattr(proposer, "AHEAD_CAP", 2)
    assert proposer.ahead_cap(RING_BYTES, K) == 2
    assert proposer.ahead_cap(1, K) == 2


def test_an_engine_with_graphs_gets_a_ring_for_its_cap(tmp_path):
    ckpt = str(make_tiny_checkpoint(tmp_path / "m", "qwen3_5_text", seed=8, with_mtp=True))
    llm = LLM(ckpt, device="cpu", dtype="float32", num_pages=64, page_size=4,
              max_running_reqs=4, speculative_algorithm="mtp", speculative_num_steps=K)
    eng = llm.engine
    eng.spec.use_graphs(4, eng.max_model_len, capture=False)
    p = eng.spec.proposer
    step_bytes = 4 * eng.model.config.hidden_size * eng.model.dtype.itemsize
    assert p.ahead_cap == proposer.ahead_cap(step_bytes, K)
    assert p.hidden_steps_held == p.ahead_cap + 2 * (K + 1)
    assert hidden_ring_steps(eng.spec, eng.model, 4) == p.hidden_steps_held + 8
