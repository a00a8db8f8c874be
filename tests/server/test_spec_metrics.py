"""/metrics carries speculative decoding's counters (vLLM's spec_decode families) when the
server's engine speculates, read from the engine's own verify counters, and none without
speculation."""

from __future__ import annotations

import httpx
import pytest
from live_server import LiveServer, make_tiny_model
from prometheus_client.parser import text_string_to_metric_families

from deltaserve import LLM, SamplingParams
from deltaserve.config import EngineConfig
from deltaserve.engine.llm_engine import LLMEngine
from deltaserve.engine.status import spec_status
from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine
from deltaserve.spec.proposer import Proposer

NAMES = ["deltaserve_spec_decode_verify_steps_total", "deltaserve_spec_decode_drafts_total",
         "deltaserve_spec_decode_draft_tokens_total",
         "deltaserve_spec_decode_accepted_tokens_total"]
PROMPT = "def add(a, b):\n    return a + b\n"
TOKENS = 24


class TwoRightProposer(Proposer):
    """k = 3 drafts: the next two tokens of the known greedy output, then a wrong one, so
    each verify step commits 3 tokens (2 drafts accepted, then the target's own)."""

    num_steps = 3

    def __init__(self, greedy: list[int]) -> None:
        self.greedy = greedy

    def propose(self, reqs):
        n = len(reqs[0].output_ids)
        right = self.greedy[n:n + 2]
        return [right + [self.greedy[n + 2] + 1] if n + 2 < len(self.greedy) else right]


def samples(text: str) -> dict[str, float]:
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    model = str(make_tiny_model(tmp_path_factory.mktemp("spec") / "tiny"))
    kw = dict(device="cpu", dtype="float32", page_size=16, num_pages=160)
    plain = LLM(model, **kw)
    ids = plain.tokenizer.encode(PROMPT, add_special_tokens=False)
    out = plain.generate([ids], SamplingParams(temperature=0.0, max_tokens=TOKENS,
                                               ignore_eos=True))[0]
    engine = LLMEngine(EngineConfig(model=model, max_model_len=512, max_running_reqs=4,
                                    speculative_algorithm="ngram", speculative_num_steps=3,
                                    speculative_policy="fixed", **kw))
    engine.spec.proposer = TwoRightProposer(out.token_ids)
    served = AsyncEngine(engine)
    server = LiveServer(build_app(served))
    server.start()
    try:
        yield server.base_url, engine, out.text
    finally:
        server.stop()
        served.shutdown()


def test_the_spec_counters_are_the_engines_and_count_each_verify(spec_server):
    base, engine, text = spec_server
    with httpx.Client(base_url=base, timeout=60) as client:
        before = samples(client.get("/metrics").text)
        assert [before[n] for n in NAMES] == [0, 0, 0, 0]
        r = client.post("/v1/completions", json={
            "prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        assert r.json()["choices"][0]["text"] == text  # the drafts change no token
        after = samples(client.get("/metrics").text)
    # the prefill gives the first token; each verify then commits two right drafts and the
    # target's own token (its third draft is wrong), until max_tokens cuts the last
    got = [after[n] for n in NAMES]
    steps = got[0]
    assert got[1] == steps  # one request: one verify of it a step
    assert got[2] <= 3 * steps and got[3] < got[2]  # the wrong drafts are not accepted
    assert steps + got[3] >= TOKENS - 1  # every token after the first: a verify's
    assert got[3] >= 2 * (steps - 1)  # 2 of 3 drafts right at every step but the last
    status = spec_status(engine)  # idle now: the engine's counters stand still
    assert [status[k] for k in ("verify_steps", "drafts", "draft_tokens",
                                "accepted_tokens")] == got


def test_no_spec_counters_without_speculation(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "temperature": 0})
    got = samples(client.get("/metrics").text)
    assert not any(n in got for n in NAMES)
