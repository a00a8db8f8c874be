"""Input bounds over real HTTP: the body cap (413), the prompt character bound checked before
tokenizing, and the caps on stop_token_ids, logit_bias and messages (400); then the prompt
character bound itself against the tokenizer."""

from __future__ import annotations

import gzip
import json
import random
import socket
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from live_server import MAX_MODEL_LEN
from test_http import assert_openai_error

from deltaserve.server.limits import (
    DEFAULT_MAX_REQUEST_BYTES,
    FALLBACK_CHARS_PER_TOKEN,
    MAX_LOGIT_BIAS,
    MAX_MESSAGES,
    MAX_STOP_TOKEN_IDS,
    chars_per_token_bound,
)

JSON = {"Content-Type": "application/json"}


def test_a_60_mb_body_gets_413_and_the_server_keeps_serving(client):
    body = json.dumps({"prompt": "b" * (60 * 1024 * 1024)}).encode()
    r = client.post("/v1/completions", content=body, headers=JSON)
    error = assert_openai_error(r, 413, None)
    assert str(DEFAULT_MAX_REQUEST_BYTES) in error["message"] and "--max-request-bytes" in \
        error["message"]
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200


def test_a_chunked_body_over_the_cap_gets_413_without_a_content_length(client):
    def chunks():
        for _ in range(DEFAULT_MAX_REQUEST_BYTES // (1 << 20) + 2):
            yield b" " * (1 << 20)

    r = client.post("/v1/completions", content=chunks(), headers=JSON)
    assert_openai_error(r, 413, None)


def test_a_declared_length_over_the_cap_is_refused_before_the_body_is_sent(served):
    host, port = served.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\n"
                     b"Content-Length: 62914560\r\n\r\n{")  # 60 MiB promised, 1 byte sent
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]


@pytest.mark.parametrize("coding", ["gzip", "GZip", "br", "identity, gzip", "x-custom"])
def test_a_compressed_body_gets_415_naming_the_coding_and_the_server_keeps_serving(client,
                                                                                  coding):
    body = gzip.compress(json.dumps({"prompt": "Hi", "max_tokens": 1}).encode())
    for route in ("/v1/completions", "/v1/chat/completions", "/v1/cache/flush"):
        r = client.post(route, content=body, headers={**JSON, "Content-Encoding": coding})
        error = assert_openai_error(r, 415, "Content-Encoding")
        assert error == {
            "message": f"Content-Encoding {coding.split(', ')[-1].lower()!r} is not supported: "
                       "send the request body uncompressed (no Content-Encoding, or identity)",
            "type": "invalid_request_error", "param": "Content-Encoding",
            "code": "unsupported_content_encoding"}
        assert r.headers["accept-encoding"] == "identity" and r.headers["connection"] == "close"
    ok = client.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize("coding", ["identity", "IDENTITY", "Identity", ""])
def test_an_identity_or_empty_content_encoding_is_served_as_a_plain_body(client, coding):
    body = json.dumps({"prompt": "Hi", "max_tokens": 1}).encode()
    r = client.post("/v1/completions", content=body,
                    headers={**JSON, "Content-Encoding": coding})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 1


def test_a_compressed_body_is_refused_before_it_is_sent(served):
    host, port = served.base_url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nContent-Encoding: gzip\r\n"
                     b"Content-Length: 1000\r\n\r\n\x1f")  # 1000 promised, 1 byte sent
        answer = b""
        while b"\r\n\r\n" not in answer:
            answer += sock.recv(65536)
    assert answer.startswith(b"HTTP/1.1 415"), answer[:200]


def test_an_8_mb_prompt_is_refused_by_the_character_bound_not_tokenized(client, served):
    eight_mb = "a" * (8 * 1024 * 1024)
    r = client.post("/v1/completions", json={"prompt": eight_mb, "max_tokens": 1})
    error = assert_openai_error(r, 400, "prompt")
    assert error["code"] == "context_length_exceeded" and str(MAX_MODEL_LEN) in error["message"]
    chat = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": eight_mb}], "max_tokens": 1})
    assert assert_openai_error(chat, 400, "messages")["code"] == "context_length_exceeded"


def test_3_million_stop_token_ids_are_a_400_naming_the_field(client):
    body = b'{"prompt": "Hi", "max_tokens": 1, "stop_token_ids": [' + \
        b",".join([b"1"] * 3_000_000) + b"]}"
    r = client.post("/v1/completions", content=body, headers=JSON)
    error = assert_openai_error(r, 400, "stop_token_ids")
    assert str(MAX_STOP_TOKEN_IDS) in error["message"]


def test_the_caps_refuse_one_past_and_accept_exactly_the_limit(client):
    prompt = {"prompt": "Hi", "max_tokens": 1}
    at = client.post("/v1/completions", json={**prompt,
                                              "stop_token_ids": [1] * MAX_STOP_TOKEN_IDS})
    assert at.status_code == 200, at.text
    past = client.post("/v1/completions", json={**prompt,
                                                "stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)})
    assert_openai_error(past, 400, "stop_token_ids")
    bias = {str(i): 1.0 for i in range(MAX_LOGIT_BIAS + 1)}
    r = client.post("/v1/completions", json={**prompt, "logit_bias": bias})
    assert str(MAX_LOGIT_BIAS) in assert_openai_error(r, 400, "logit_bias")["message"]
    turn = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    many = turn * (MAX_MESSAGES // 2) + [{"role": "user", "content": "Hi"}]
    r = client.post("/v1/chat/completions", json={"messages": many, "max_tokens": 1})
    assert str(MAX_MESSAGES) in assert_openai_error(r, 400, "messages")["message"]


def test_the_default_tokenizers_bound_is_its_longest_token_and_is_reached(served):
    tokenizer = served.engine.tokenizer
    bound = chars_per_token_bound(tokenizer)
    lengths = {i: len(tokenizer.decode([i])) for i in tokenizer.get_vocab().values()}
    longest = max(lengths, key=lengths.get)
    assert bound == lengths[longest]
    text = tokenizer.decode([longest]) * 10  # the bound is reached: 10 tokens of `bound` chars
    assert len(tokenizer.encode(text, add_special_tokens=False)) == 10


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.text(min_size=1, max_size=400))
def test_no_text_tokenizes_to_fewer_tokens_than_its_length_over_the_bound(served, text):
    tokenizer = served.engine.tokenizer
    text = text.encode("utf-8", "replace").decode("utf-8")  # no lone surrogates
    n_tokens = len(tokenizer.encode(text, add_special_tokens=False))
    assert n_tokens * chars_per_token_bound(tokenizer) >= len(text)


def test_runs_of_the_longest_characters_stay_within_the_bound(served):
    tokenizer = served.engine.tokenizer
    bound, rng = chars_per_token_bound(tokenizer), random.Random(0)
    for char in (" ", "\n", "#", "=", "-", "a", "0", "\t"):
        for _ in range(5):
            text = char * rng.randint(1, 3000)
            assert len(tokenizer.encode(text, add_special_tokens=False)) * bound >= len(text)


class _Backend:
    def __init__(self, normalizer: dict | None, decoder: str = "ByteLevel") -> None:
        self.spec = {"normalizer": normalizer, "decoder": {"type": decoder}}

    def to_str(self) -> str:
        return json.dumps(self.spec)

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return "x" * (ids[0] + 1)


@pytest.mark.parametrize("normalizer,decoder,bound", [
    (None, "ByteLevel", 8),
    ({"type": "NFC"}, "ByteLevel", 32),  # NFC composes up to 4 code points into one
    ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "Lowercase"}]},
     "ByteLevel", 32),
    ({"type": "Replace", "pattern": {"String": "  "}, "content": " "}, "ByteLevel",
     FALLBACK_CHARS_PER_TOKEN),  # a replacement may shrink the text without end
    (None, "WordPiece", FALLBACK_CHARS_PER_TOKEN),  # its pre-tokenizer drops whitespace
])
def test_the_bound_widens_for_normalizers_and_falls_back_when_unknowable(normalizer, decoder,
                                                                          bound):
    tokenizer = SimpleNamespace(backend_tokenizer=_Backend(normalizer, decoder),
                                get_vocab=lambda: {"a": 0, "b": 7, "c": 3})
    assert chars_per_token_bound(tokenizer) == bound


def test_a_refused_body_is_drained_only_within_its_byte_and_time_bounds(monkeypatch):
    import asyncio

    from deltaserve.server import limits

    chunk = b"x" * (1 << 20)
    taken = []

    async def endless():  # a client that never stops sending
        taken.append(len(chunk))
        return {"type": "http.request", "body": chunk, "more_body": True}

    monkeypatch.setattr(limits, "DRAIN_MAX_BYTES", 8 * len(chunk))
    asyncio.run(limits._drain(endless))
    assert sum(taken) == 9 * len(chunk)  # one chunk past the bound, then it stops

    async def silent():  # a client that stops sending but keeps the connection
        await asyncio.sleep(3600)

    monkeypatch.setattr(limits, "DRAIN_MAX_SECONDS", 0.05)
    asyncio.run(asyncio.wait_for(limits._drain(silent), 30))  # returns: the time bound

    async def last():
        return {"type": "http.request", "body": b"tail", "more_body": False}

    asyncio.run(limits._drain(last))  # the body's end ends the drain


def _stalled():  # part of the body, then nothing
    yield b"{"
    yield None


def _trickle():  # a byte every 10 ms, for ever
    while True:
        yield b" "


def _slow():  # 20 bytes 10 ms apart, then the end
    yield b"{"
    for _ in range(20):
        yield b" "
    yield b"}"


@pytest.mark.parametrize("client, want", [(_stalled, 408), (_trickle, 408), (_slow, 200)])
def test_a_body_that_stops_arriving_gets_408_and_a_slow_one_gets_through(monkeypatch, client,
                                                                         want):
    """Idle bound 0.2 s (the stalled client), total bound 0.5 s (the trickle); a client 10 ms
    between chunks that finishes in time is passed on whole."""
    import asyncio

    from deltaserve.server import limits

    monkeypatch.setattr(limits, "BODY_IDLE_SECONDS", 0.2)
    monkeypatch.setattr(limits, "BODY_MAX_SECONDS", 0.5)
    parts, sent = client(), []

    async def receive():
        part = next(parts)
        if part is None:
            await asyncio.sleep(3600)
        await asyncio.sleep(0.01)
        return {"type": "http.request", "body": part, "more_body": part != b"}"}

    async def send(message):
        sent.append(message)

    async def app(scope, receive, send):
        assert (await receive())["body"] == b"{" + b" " * 20 + b"}"
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": []}
    asyncio.run(asyncio.wait_for(limits.BodyLimit(app, 1 << 20)(scope, receive, send), 30))
    assert sent[0]["status"] == want
    if want == 408:
        assert (b"connection", b"close") in sent[0]["headers"]


_PIECES = st.lists(st.sampled_from(["def f(x):\n", "    return x\n", "\n\n", "    ", " ", "\t",
                                    "é", "漢字", "==", "# note\n", "\r\n", "x" * 30, "🙂"]),
                   min_size=1, max_size=300)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(_PIECES, st.integers(0, 40))
def test_counting_in_pieces_never_refuses_a_text_that_fits(served, pieces, under):
    """Cut into pieces of at most 40 characters (many cuts), a text is said to reach the
    limit only when its own tokenization does (the HTTP test below shows it is found)."""
    from unittest import mock

    from deltaserve.server import limits

    tokenizer, text = served.engine.tokenizer, "".join(pieces)
    n = len(tokenizer.encode(text, add_special_tokens=False))
    with mock.patch.object(limits, "COUNT_PIECE_CHARS", 40), \
            mock.patch.object(limits, "COUNT_FIRST_CHARS_PER_TOKEN", 0):
        for limit in (max(1, n - under), n, n + 1, n + under + 1):
            if limits.reaches_token_limit(tokenizer, text, limit):
                assert n >= limit, (limit, n, text)


def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized_whole(client):
    # under the character bound (512 x the longest token), over 8 characters a token
    text = "def f(x):\n    return x + 1\n" * 700  # 19,600 characters, thousands of tokens
    r = client.post("/v1/completions", json={"prompt": text, "max_tokens": 1})
    error = assert_openai_error(r, 400, "prompt")
    assert "counted in pieces" in error["message"]
    r = client.post("/v1/chat/completions", json={
        "messages": [{"role": "user", "content": text}], "max_tokens": 1})
    assert "counted in pieces" in assert_openai_error(r, 400, "messages")["message"]
