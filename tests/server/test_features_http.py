"""logprobs, n > 1 and structured output over real HTTP with the official openai client."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
import torch

from deltaserve.model.testing import transformers_torch_kernels
from oracle import reference_model

SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string", "pattern": "^[A-Z][a-z]{1,7}$"},
    "temp": {"type": "integer", "minimum": -50, "maximum": 50}},
    "required": ["city", "temp"], "additionalProperties": False}
FORK_PROMPT = [(7 * i) % 500 + 3 for i in range(130)]  # 2 snapshots (128 tokens) deep


@pytest.fixture
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=60)


def ids_of(tokens: list[str]) -> list[int]:
    assert all(t.startswith("token_id:") for t in tokens)
    return [int(t.split(":")[1]) for t in tokens]


@torch.inference_mode()
def reference(path, prompt: list[int], output: list[int]) -> torch.Tensor:
    with transformers_torch_kernels():
        logits = reference_model(str(path))(torch.tensor([prompt + output])).logits[0]
    return torch.log_softmax(logits.float()[len(prompt) - 1:-1], dim=-1)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_are_the_reference_log_softmax(oai, served, tiny_model, stream):
    prompt = [11, 12, 13, 14, 15]
    kwargs = dict(model=served.model, prompt=prompt, max_tokens=6, temperature=0.9, seed=3,
                  logprobs=3, extra_body={"ignore_eos": True,
                                          "return_tokens_as_token_ids": True})
    if stream:
        chunks = [c for c in oai.completions.create(stream=True, **kwargs) if c.choices]
        lps = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        values = [v for lp in lps for v in lp.token_logprobs]
        tops = [t for lp in lps for t in lp.top_logprobs]
    else:
        lp = oai.completions.create(**kwargs).choices[0].logprobs
        tokens, values, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    out = ids_of(tokens)
    assert len(out) == 6
    ref = reference(tiny_model, prompt, out)
    for j, tok in enumerate(out):
        assert abs(values[j] - float(ref[j, tok])) < 2e-5  # see tests/engine/test_logprobs.py
        top = torch.topk(ref[j], 3)
        listed = ids_of(list(tops[j]))
        # the 3 most likely, then the sampled token when it is not among them (legacy API)
        assert listed[:3] == top.indices.tolist() and tok in listed
        assert len(listed) == (3 if tok in top.indices.tolist() else 4)


@pytest.mark.parametrize("prompt, healing", [
    ("def f():\n", True),  # the first token re-generates the removed "\n" too
    ("# 🐍 日本語 ", False),  # tokens that hold part of a character
])
def test_completion_text_offsets_index_the_text_streamed_and_not(oai, served, prompt, healing):
    kwargs = dict(model=served.model, prompt=prompt, max_tokens=8, temperature=0, logprobs=1,
                  extra_body={"ignore_eos": True, "token_healing": healing})
    whole = oai.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in oai.completions.create(stream=True, **kwargs) if c.choices]
    streamed = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    offsets = whole.logprobs.text_offset
    assert streamed == offsets and "".join(c.text for c in chunks) == whole.text
    assert offsets[0] == 0 and offsets == sorted(offsets) and offsets[-1] <= len(whole.text)
    tokens = whole.logprobs.tokens
    for i, (t, a) in enumerate(zip(tokens, offsets)):  # a whole token's text is at its offset
        if "\ufffd" not in t and (i or not healing):
            assert whole.text[a:a + len(t)] == t


def test_chat_logprobs_have_the_openai_shape_streamed_and_not(oai, served):
    kwargs = dict(model=served.model, messages=[{"role": "user", "content": "Hi"}],
                  max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                  extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kwargs).choices[0]
    content = full.logprobs.content
    assert len(content) == 4 and all(len(e.top_logprobs) == 2 for e in content)
    # greedy: each token is its row's most likely one
    assert all(e.token == e.top_logprobs[0].token and e.logprob <= 0 for e in content)
    assert "".join(e.token for e in content) == full.message.content
    streamed = [e for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices
                and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [(e.token, e.logprob) for e in streamed] == [(e.token, e.logprob) for e in content]


def cache_status(served) -> dict:
    return httpx.get(served.base_url + "/v1/cache/status").json()


@pytest.mark.parametrize("stream", [False, True])
def test_n_3_choices_equal_single_requests_with_seed_plus_i_and_prefill_once(
        oai, served, stream):
    httpx.post(served.base_url + "/v1/cache/flush")
    kwargs = dict(model=served.model, prompt=FORK_PROMPT, max_tokens=6, temperature=1.0,
                  extra_body={"ignore_eos": True})
    before = cache_status(served)
    if stream:
        texts = ["", "", ""]
        for c in oai.completions.create(n=3, seed=40, stream=True, **kwargs):
            for ch in c.choices:
                texts[ch.index] += ch.text
    else:
        out = oai.completions.create(n=3, seed=40, **kwargs)
        assert [c.index for c in out.choices] == [0, 1, 2]
        assert out.usage.prompt_tokens == len(FORK_PROMPT)
        assert out.usage.completion_tokens == 18
        texts = [c.text for c in out.choices]
    after = cache_status(served)
    # one prefill of the prompt (the hidden parent); the 3 choices resume 128 tokens deep
    assert after["prompt_tokens"] - before["prompt_tokens"] == 4 * len(FORK_PROMPT)
    assert after["hit_tokens"] - before["hit_tokens"] == 3 * 128
    httpx.post(served.base_url + "/v1/cache/flush")
    singles = [oai.completions.create(seed=40 + i, **kwargs).choices[0].text for i in range(3)]
    assert texts == singles
    assert len(set(singles)) == 3


def test_fifty_json_schema_outputs_all_validate(oai, served):
    out = oai.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Weather?"}], n=50, seed=0,
        max_tokens=80, temperature=1.0,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "weather", "schema": SCHEMA}})
    assert len(out.choices) == 50
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), SCHEMA)


def test_json_object_and_bad_schemas(oai, served):
    out = oai.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "x"}], max_tokens=120,
        temperature=0.5, seed=1, response_format={"type": "json_object"})
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "x"}})
    assert e.value.body["param"] == "response_format"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=served.model, prompt="x",
                               extra_body={"guided_regex": "(unclosed"})
    assert e.value.body["param"] == "guided_regex"
    # refused before any compile: too large, not enforceable, matching nothing
    refused = [({"guided_json": {"type": "string", "pattern": "a" * 70_000}}, "guided_json",
                "at most"),
               ({"guided_json": {"not": {}}}, "guided_json", "'not'"),
               ({"guided_regex": "[^\\x00-\\U0010FFFF]"}, "guided_regex", "matches no")]
    for extra, param, says in refused:
        with pytest.raises(openai.BadRequestError) as e:
            oai.completions.create(model=served.model, prompt="x", extra_body=extra)
        assert e.value.body["param"] == param and says in e.value.body["message"], extra


def test_best_of_returns_the_sample_of_highest_summed_logprob(oai, served):
    kwargs = dict(model=served.model, prompt=[21, 22, 23], max_tokens=5, temperature=1.0,
                  extra_body={"ignore_eos": True})
    out = oai.completions.create(n=1, best_of=3, seed=60, **kwargs)
    assert len(out.choices) == 1 and out.choices[0].logprobs is None
    assert out.usage.completion_tokens == 15  # every sample counts
    singles = [oai.completions.create(seed=60 + i, logprobs=0, **kwargs).choices[0]
               for i in range(3)]
    top = max(singles, key=lambda c: sum(c.logprobs.token_logprobs))
    assert out.choices[0].text == top.text
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(n=2, best_of=1, **kwargs)
    assert e.value.body["param"] == "best_of"


def test_token_healing_is_an_opt_in_completions_field_that_heals_as_the_engine_does(
        client, served, tiny_model):
    """`token_healing: true` gives the text the engine's healing gives (the LLM API on the
    same checkpoint); absent, the prompt is completed as sent; with a json_schema, not a
    boolean, or on chat it is a 400."""
    from deltaserve import LLM, SamplingParams

    prompt, body = "def f(x):\n", {"max_tokens": 8, "temperature": 0}
    llm = LLM(str(tiny_model), device="cpu", dtype="float32", page_size=16)
    want = {heal: llm.generate([prompt], SamplingParams(
        max_tokens=8, temperature=0, token_healing=heal))[0].text for heal in (False, True)}
    assert want[True] != want[False]  # the prompt's last "\n" is healed here
    for heal in (False, True):
        extra = {"token_healing": True} if heal else {}
        r = client.post("/v1/completions", json={"prompt": prompt, **body, **extra})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[heal]
    r = client.post("/v1/completions", json={
        "prompt": prompt, **body, "token_healing": True,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object"}}}})
    assert r.status_code == 400 and "token_healing" in r.json()["error"]["message"]
    r = client.post("/v1/completions", json={"prompt": prompt, **body, "token_healing": "yes"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing"
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}], **body, "token_healing": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "token_healing"


@pytest.mark.parametrize("field", ["skip_special_tokens", "spaces_between_special_tokens"])
def test_vllm_detokenizer_options_set_to_false_are_refused_not_ignored(client, field):
    body = {"prompt": "x", "max_tokens": 2}
    assert client.post("/v1/completions", json={**body, field: True}).status_code == 200
    r = client.post("/v1/completions", json={**body, field: False})
    assert r.status_code == 400 and r.json()["error"]["param"] == field


def test_a_json_schema_ref_to_another_document_is_refused(client):
    schema = {"type": "object", "properties": {"a": {"$ref": "http://example.com/x.json"}}}
    r = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 4,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 400 and "$ref" in r.json()["error"]["message"]
    local = {"$defs": {"n": {"type": "integer"}}, "type": "object",
             "properties": {"a": {"$ref": "#/$defs/n"}}, "required": ["a"]}
    r = client.post("/v1/completions", json={
        "prompt": "x", "max_tokens": 12,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": local}}})
    assert r.status_code == 200, r.text
