"""The HTTP API over real loopback HTTP: completions, chat, streaming, prefix-cache usage,
OpenAI error objects, client disconnects, cache flush, metrics, models and health."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
from live_server import MAX_MODEL_LEN
from prometheus_client.parser import text_string_to_metric_families

GREEDY = {"temperature": 0, "ignore_eos": True}


def long_text(tokenizer, n_tokens: int = 200) -> str:
    """A text of about `n_tokens` tokens (well past two 64-token snapshot boundaries)."""
    words = []
    while len(tokenizer.encode(" ".join(words))) < n_tokens:
        words.append(f"item{len(words)} is fine.")
    return " ".join(words)


def sse_events(response: httpx.Response) -> list[dict | str]:
    """The data payloads of an SSE response ([DONE] kept as the string)."""
    events = []
    for line in response.iter_lines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
        else:
            assert line == "", f"unexpected SSE line {line!r}"
    return events


def assert_openai_error(response: httpx.Response, status: int, param: str | None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    assert error["param"] == param, error
    if status == 400:
        assert error["type"] == "invalid_request_error"
    return error


def cache_status(client: httpx.Client) -> dict:
    response = client.get("/v1/cache/status")
    assert response.status_code == 200
    return response.json()


def wait_idle(client: httpx.Client, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        status = cache_status(client)
        if status["running_requests"] == 0 and status["waiting_requests"] == 0:
            return status
        assert time.monotonic() < deadline, f"requests still running: {status}"
        time.sleep(0.05)


def test_a_completion_returns_text_finish_reason_and_usage(client, served):
    r = client.post("/v1/completions", json={"model": served.model, "prompt": "Hello",
                                              "max_tokens": 5, **GREEDY})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == served.model
    (choice,) = body["choices"]
    assert isinstance(choice["text"], str) and choice["finish_reason"] == "length"
    usage = body["usage"]
    assert usage["completion_tokens"] == 5
    assert usage["total_tokens"] == usage["prompt_tokens"] + 5
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0


def test_a_prompt_of_token_ids_or_a_one_element_list_of_either_is_accepted(client):
    ids = client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2, **GREEDY})
    assert ids.status_code == 200 and ids.json()["usage"]["prompt_tokens"] == 3
    one = client.post("/v1/completions", json={"prompt": ["Hello"], "max_tokens": 2, **GREEDY})
    assert one.status_code == 200, one.text
    nested = client.post("/v1/completions", json={"prompt": [[5, 6, 7]], "max_tokens": 2,
                                                   **GREEDY})
    assert nested.status_code == 200, nested.text
    assert nested.json()["choices"] == ids.json()["choices"]
    for batch in (["a", "b"], [[5], [6]]):
        two = client.post("/v1/completions", json={"prompt": batch, "max_tokens": 2})
        assert_openai_error(two, 400, "prompt")
    empty = client.post("/v1/completions", json={"prompt": [[]], "max_tokens": 2})
    assert_openai_error(empty, 400, "prompt")


def test_a_streamed_completion_concatenates_to_the_non_streamed_text(client):
    request = {"prompt": "Once upon a time", "max_tokens": 8, **GREEDY}
    full = client.post("/v1/completions", json=request).json()
    with client.stream("POST", "/v1/completions",
                       json={**request, "stream": True,
                             "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == [] and usage_chunk["usage"] == full["usage"]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert text == full["choices"][0]["text"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client):
    request = {"prompt": "Once upon a time", "max_tokens": 6, "n": 2, **GREEDY}
    full = client.post("/v1/completions", json=request).json()
    options = {"include_usage": True, "continuous_usage_stats": True}
    with client.stream("POST", "/v1/completions",
                       json={**request, "stream": True, "stream_options": options}) as r:
        events = sse_events(r)
    assert events[-1] == "[DONE]" and events[-2]["usage"] == full["usage"]
    chunks = events[:-2]
    for chunk in chunks:
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == full["usage"]["prompt_tokens"]
        assert 1 <= usage["completion_tokens"] <= full["usage"]["completion_tokens"] == 12
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert chunks[-1]["usage"] == full["usage"]
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts)
    with client.stream("POST", "/v1/completions",  # without include_usage: no usage at all
                       json={**request, "stream": True,
                             "stream_options": {"continuous_usage_stats": True}}) as r:
        assert all(e == "[DONE]" or e["usage"] is None for e in sse_events(r))


def test_chat_applies_the_template_and_streams_role_then_content(client, served):
    request = {"model": served.model, "max_tokens": 6, **GREEDY,
               "messages": [{"role": "system", "content": "Be brief."},
                            {"role": "user", "content": [{"type": "text", "text": "Hi!"}]}]}
    r = client.post("/v1/chat/completions", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion"
    message = body["choices"][0]["message"]
    assert message["role"] == "assistant" and isinstance(message["content"], str)
    assert body["usage"]["completion_tokens"] == 6
    with client.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as s:
        events = sse_events(s)
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert text == message["content"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_a_repeated_long_prompt_is_served_from_the_prefix_cache_with_equal_output(client,
                                                                                 served):
    request = {"prompt": long_text(served.engine.tokenizer), "max_tokens": 6, **GREEDY}
    first = client.post("/v1/completions", json=request).json()
    assert first["usage"]["prompt_tokens"] > 128
    second = client.post("/v1/completions", json=request).json()
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_concurrent_requests_are_batched_and_match_their_sequential_outputs(client, served):
    prompts = ["The sky is", "Numbers: 1, 2, 3", "def main():", "Dear friend,"]
    requests = [{"prompt": p, "max_tokens": 8, **GREEDY} for p in prompts]
    alone = [client.post("/v1/completions", json=r).json()["choices"][0]["text"]
             for r in requests]

    async def together() -> list[str]:
        async with httpx.AsyncClient(base_url=served.base_url, timeout=30) as c:
            rs = await asyncio.gather(*(c.post("/v1/completions", json=r) for r in requests))
        return [r.json()["choices"][0]["text"] for r in rs]

    assert asyncio.run(together()) == alone


def test_a_prompt_over_the_context_limit_is_a_400_naming_the_field(client):
    too_long = list(range(3, 3 + MAX_MODEL_LEN))
    assert_openai_error(client.post("/v1/completions", json={"prompt": too_long}), 400,
                        "prompt")
    chat = {"messages": [{"role": "user", "content": "x " * MAX_MODEL_LEN}]}
    assert_openai_error(client.post("/v1/chat/completions", json=chat), 400, "messages")
    budget = {"prompt": "Hi", "max_tokens": MAX_MODEL_LEN}
    assert_openai_error(client.post("/v1/completions", json=budget), 400, "max_tokens")


def test_text_with_a_lone_surrogate_is_a_400_and_the_server_keeps_serving(client):
    chat = b'{"messages": [{"role": "user", "content": "a\\ud800"}]}'
    for path, body in [
            ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
            ("/v1/completions", b'{"prompt": "a\\udfff", "max_tokens": 2, "stream": true}'),
            ("/v1/chat/completions", chat)]:
        r = client.post(path, content=body, headers={"content-type": "application/json"})
        param = "messages" if "chat" in path else "prompt"
        assert "surrogate" in assert_openai_error(r, 400, param)["message"]
    stop = b'{"prompt": "Hi", "max_tokens": 2, "stop": ["\\ud800"]}'
    r = client.post("/v1/completions", content=stop, headers={"content-type": "application/json"})
    assert "surrogate" in assert_openai_error(r, 400, "stop")["message"]
    model = b'{"model": "\\ud800", "prompt": "Hi", "max_tokens": 2}'
    r = client.post("/v1/completions", content=model, headers={"content-type": "application/json"})
    assert "\\ud800" in assert_openai_error(r, 404, "model")["message"]
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **GREEDY})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


def test_token_ids_outside_the_vocabulary_are_a_400(client):
    r = client.post("/v1/completions", json={"prompt": [1, 10**9], "max_tokens": 2})
    assert "token ids" in assert_openai_error(r, 400, "prompt")["message"]


def test_bad_sampling_parameters_are_a_400_naming_the_field(client):
    cases = [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"),
             ({"top_k": -5}, "top_k"), ({"max_tokens": 0}, "max_tokens"),
             ({"presence_penalty": 3}, "presence_penalty"), ({"n": 0}, "n"),
             ({"logprobs": 21}, "logprobs"), ({"temperature": "hot"}, "temperature"),
             ({"stop": [""]}, "stop")]
    for extra, param in cases:
        r = client.post("/v1/completions", json={"prompt": "Hi", **extra})
        assert_openai_error(r, 400, param)
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for extra, param in [({"max_completion_tokens": 0}, "max_completion_tokens"),
                         ({"top_logprobs": 3}, "top_logprobs"), ({"top_p": 1.5}, "top_p")]:
        r = client.post("/v1/chat/completions", json={**chat, **extra})
        assert_openai_error(r, 400, param)


def test_malformed_requests_are_400_and_unknown_routes_404(client):
    bad_json = client.post("/v1/completions", content=b'{"prompt": "Hi",',
                           headers={"content-type": "application/json"})
    assert "JSON" in assert_openai_error(bad_json, 400, None)["message"]
    not_utf8 = client.post("/v1/completions", content=b'{"prompt": "\xff\xfe", "max_tokens": 2}',
                           headers={"content-type": "application/json"})
    assert "not valid UTF-8 (byte 12)" in assert_openai_error(not_utf8, 400, None)["message"]
    form = client.post("/v1/completions", data={"prompt": "Hi"})
    assert "application/x-www-form-urlencoded" in assert_openai_error(form, 400, None)["message"]
    as_text = client.post("/v1/completions", content=b'{"prompt": "Hi"}',
                          headers={"content-type": "text/plain"})
    assert "(not text/plain)" in assert_openai_error(as_text, 400, None)["message"]
    untyped = client.post("/v1/completions", content=b'{"prompt": "Hi"}',
                          headers={"content-type": ""})
    assert assert_openai_error(untyped, 400, None)["message"].endswith(
        "sent as Content-Type: application/json (the request has none)")
    array = client.post("/v1/completions", json=["Hi"])
    assert "not an array" in assert_openai_error(array, 400, None)["message"]
    for field, value in [("max_tokens", True), ("max_tokens", "3"), ("top_k", True),
                         ("temperature", "0.5"), ("temperature", 1e308), ("seed", 2**64)]:
        r = client.post("/v1/completions", json={"prompt": "Hi", field: value})
        assert_openai_error(r, 400, field)
    # a valid seed whose last choice's seed + i is not: a 400, in both APIs, streamed or not
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for path, body, extra in [("/v1/completions", {"prompt": "Hi"}, {"n": 2}),
                              ("/v1/completions", {"prompt": "Hi"}, {"best_of": 2}),
                              ("/v1/completions", {"prompt": "Hi"}, {"n": 2, "stream": True}),
                              ("/v1/chat/completions", chat, {"n": 2}),
                              ("/v1/chat/completions", chat, {"n": 2, "stream": True})]:
        r = client.post(path, json={**body, "seed": 2**64 - 1, "max_tokens": 1, **extra})
        assert "seed + n - 1" in assert_openai_error(r, 400, "seed")["message"]
    booleans = client.post("/v1/completions", json={"prompt": [True, False]})
    assert_openai_error(booleans, 400, "prompt")
    null_prompt = client.post("/v1/completions", json={"prompt": None})
    message = assert_openai_error(null_prompt, 400, "prompt")["message"]
    assert "got null" in message and "list[int]" in message
    missing = client.post("/v1/chat/completions", json={"max_tokens": 3})
    assert_openai_error(missing, 400, "messages")
    bad_role = client.post("/v1/chat/completions",
                           json={"messages": [{"role": "wizard", "content": "Hi"}]})
    assert_openai_error(bad_role, 400, "messages.0.role")
    assert_openai_error(client.get("/v1/nothing"), 404, None)
    wrong_model = client.post("/v1/completions", json={"model": "gpt-9", "prompt": "Hi"})
    assert_openai_error(wrong_model, 404, "model")


def test_a_failing_engine_step_is_a_500_and_the_server_keeps_serving(client, served):
    served.flaky.fail_next_step = True
    r = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **GREEDY})
    assert_openai_error(r, 500, None)
    assert r.json()["error"]["type"] == "server_error"
    again = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 3, **GREEDY})
    assert again.status_code == 200
    wait_idle(client)


def test_an_engine_failure_mid_stream_ends_the_stream_with_an_error_event(served):
    request = {"prompt": "A long story", "max_tokens": MAX_MODEL_LEN - 32, "stream": True,
               **GREEDY}
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=request) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            served.flaky.fail_next_step = True
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"
        error = json.loads(rest[-2][len("data: "):])["error"]
        assert error["type"] == "server_error" and "injected" in error["message"]
        wait_idle(c)


def test_a_stop_string_cuts_the_text_and_finishes_with_stop(client):
    request = {"prompt": "Once upon a time", "max_tokens": 12, **GREEDY}
    text = client.post("/v1/completions", json=request).json()["choices"][0]["text"]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    cut = client.post("/v1/completions", json={**request, "stop": stop}).json()
    assert cut["choices"][0]["text"] == text[:text.index(stop)]
    assert cut["choices"][0]["finish_reason"] == "stop"


def test_a_client_that_disconnects_mid_stream_is_aborted_and_its_pages_freed(served):
    request = {"prompt": "Tell me a long story", "max_tokens": MAX_MODEL_LEN - 32,
               "stream": True, **GREEDY}
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        aborted_before = _counter(c, "deltaserve_requests", finish_reason="abort")
        with c.stream("POST", "/v1/completions", json=request) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            status = cache_status(c)
            assert status["running_requests"] == 1
        # leaving the block closes the connection mid-stream
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        status = wait_idle(c)
        assert status["pages_free"] + status["pages_cached"] == status["pages_total"]
        assert status["slots_free"] + status["slots_snapshot"] == status["slots_total"]
        assert _counter(c, "deltaserve_requests", finish_reason="abort") == aborted_before + 1
        assert served.engine.num_inflight == 0


def test_after_all_requests_end_a_flush_frees_every_page_and_slot(client, served):
    prompt = long_text(served.engine.tokenizer)
    client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 3, **GREEDY})
    wait_idle(client)
    r = client.post("/v1/cache/flush")
    assert r.status_code == 200 and r.json()["flushed"] is True
    status = cache_status(client)
    assert status["pages_free"] == status["pages_total"]
    assert status["slots_free"] == status["slots_total"]
    assert status["host_slots_used"] == status["host_bytes_used"] == 0
    assert r.json()["cache_status"] == status


def _counter(client: httpx.Client, name: str, **labels: str) -> float:
    for family in text_string_to_metric_families(client.get("/metrics").text):
        for sample in family.samples:
            if sample.name == name + "_total" and all(
                    sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return 0.0


def test_metrics_parse_as_prometheus_text_with_request_and_cache_series(client):
    client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, **GREEDY})
    r = client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s for f in text_string_to_metric_families(r.text) for s in f.samples}
    for name in ["deltaserve_requests_total", "deltaserve_prompt_tokens_total",
                 "deltaserve_generation_tokens_total", "deltaserve_cached_prompt_tokens_total",
                 "deltaserve_requests_running", "deltaserve_requests_waiting",
                 "deltaserve_pages_used", "deltaserve_pages_reserved", "deltaserve_slots_used"]:
        assert name in samples, name
    assert samples["deltaserve_generation_tokens_total"].value >= 2


def test_models_and_health(client, served):
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == [served.model]
    one = client.get(f"/v1/models/{served.model}")
    assert one.status_code == 200 and one.json() == {**models["data"][0],
                                                     "created": one.json()["created"]}
    missing = client.get("/v1/models/org/not-this-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "model_not_found"
    assert "org/not-this-model" in missing.json()["error"]["message"]
    assert client.get("/v1/models/").status_code == 404  # names no model
    assert client.get("/health").json() == {"status": "ok"}
    head = client.head("/health")  # load balancers and probes often send HEAD
    assert head.status_code == 200 and head.content == b""


def test_a_client_that_gives_up_on_a_non_streamed_request_gets_it_aborted(served):
    request = {"prompt": "Tell me a long story", "max_tokens": MAX_MODEL_LEN - 32, **GREEDY}
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        aborted_before = _counter(c, "deltaserve_requests", finish_reason="abort")
    with httpx.Client(base_url=served.base_url, timeout=0.3) as c:
        try:
            c.post("/v1/completions", json=request)
        except httpx.ReadTimeout:
            pass  # the client closes the connection
    with httpx.Client(base_url=served.base_url, timeout=30) as c:
        status = wait_idle(c)
        assert status["pages_free"] + status["pages_cached"] == status["pages_total"]
        assert status["slots_free"] + status["slots_snapshot"] == status["slots_total"]
        assert _counter(c, "deltaserve_requests", finish_reason="abort") == aborted_before + 1
