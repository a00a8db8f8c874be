"""Input bounds checked before any expensive work: the request-body cap (an ASGI middleware
answering 413, and 415 for a body in a Content-Encoding other than identity), the per-field
caps of the request models, and the prompt character bound derived from the context length
and the tokenizer's vocabulary.

A refused request must cost little and keep nothing: the body cap counts bytes as they arrive
(a declared Content-Length over the cap is refused before a byte is read), and the character
bound is checked on the parsed text before the tokenizer runs (tokenizing ~8 MB took 10 s).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.server.errors import error_response

if TYPE_CHECKING:
    from starlette.responses import Response

logger = logging.getLogger("deltaserve.server")

DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
# Before a 413, what the client is still sending is read and dropped, within these bounds (as
# nginx's lingering close): a server that closes a connection with unread bytes in its buffer
# resets it, and the reset can destroy the 413 before the client reads it (seen on a loaded
# 2-core machine with a 60 MB body). Nothing read is kept.
DRAIN_MAX_BYTES = 64 * 1024 * 1024
DRAIN_MAX_SECONDS = 1.0
# A body that stops arriving (a client that sends part of it and waits: slowloris) gets 408
# after this long without a byte, or once the whole body has taken BODY_MAX_SECONDS (a 16 MiB
# body at 1 MB/s takes 16 s); the connection is closed, so it holds nothing.
BODY_IDLE_SECONDS = 30.0
BODY_MAX_SECONDS = 300.0
# per-field caps (400 past them): each entry is looked at for every sampled token or rendered
# into the prompt, so one request with millions of them stalls every stream in the batch.
# 2048 messages is OpenAI's own limit; no vocabulary needs more stop ids or bias entries.
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024
MAX_MESSAGES = 2048
# used when the tokenizer's vocabulary gives no bound (not byte-level BPE): generous
FALLBACK_CHARS_PER_TOKEN = 256
# NFC/NFKC may compose up to 4 code points into one (U+1F87 = alpha + 3 marks), so a
# normalizing tokenizer sees at least a quarter of the characters it was sent
_NORMALIZED_CHARS_PER_CHAR = 4


def chars_per_token_bound(tokenizer: Any) -> int:
    """An upper bound on how many characters of input one token covers, for `tokenizer` (a
    transformers fast tokenizer): the longest decoded vocabulary entry, times 4 when the
    tokenizer normalizes (NFC composes up to 4 code points into one). A byte-level BPE keeps
    every input byte, so a text of c characters cannot tokenize to fewer than c / bound tokens.
    Other tokenizers (a pre-tokenizer may drop whitespace) get FALLBACK_CHARS_PER_TOKEN."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return FALLBACK_CHARS_PER_TOKEN
    spec = json.loads(backend.to_str())
    decoder, normalizer = spec.get("decoder") or {}, spec.get("normalizer")
    if decoder.get("type") != "ByteLevel":
        return FALLBACK_CHARS_PER_TOKEN
    if normalizer is not None and not _composes_only(normalizer):
        return FALLBACK_CHARS_PER_TOKEN
    ids = list(tokenizer.get_vocab().values())
    longest = max((len(backend.decode([i], skip_special_tokens=False)) for i in ids), default=1)
    # an added (special) token is matched as its content, which decode() returns verbatim
    factor = 1 if normalizer is None else _NORMALIZED_CHARS_PER_CHAR
    return max(1, longest) * factor


# A text of more than COUNT_FIRST_CHARS_PER_TOKEN characters per token of the context (natural
# text runs 3-5 characters a token; the character bound above allows up to the longest token,
# 64 for the default model) is counted in pieces before it is tokenized whole, so a prompt
# far over the context is refused after tokenizing about a context's worth of it (a 2 M
# character prompt took 1.6-7 s to tokenize whole, then was refused).
COUNT_FIRST_CHARS_PER_TOKEN = 8
COUNT_PIECE_CHARS = 64 * 1024
# what a cut between two pieces can add to their counts over the text's own: the cut splits
# the pre-token(s) around it, each piece tokenized alone (a few tokens)
CUT_SLACK_TOKENS = 8


def reaches_token_limit(tokenizer: Any, text: str, limit: int) -> bool:
    """True when `text` surely tokenizes to `limit` tokens or more: counted in pieces of about
    COUNT_PIECE_CHARS cut after a newline, stopping as soon as the pieces' count less
    CUT_SLACK_TOKENS per cut reaches `limit`. False when it does not (the caller tokenizes the
    text whole), and at once for texts of at most COUNT_FIRST_CHARS_PER_TOKEN * limit
    characters. `tokenizer`: a transformers tokenizer (its Rust backend when it has one)."""
    if len(text) <= COUNT_FIRST_CHARS_PER_TOKEN * limit:
        return False
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        def count(piece: str) -> int:
            return len(backend.encode(piece, add_special_tokens=False).ids)
    else:
        def count(piece: str) -> int:
            return len(tokenizer.encode(piece, add_special_tokens=False))
    total, start, pieces = 0, 0, 0
    while start < len(text):
        end = min(start + COUNT_PIECE_CHARS, len(text))
        if end < len(text):
            newline = text.rfind("\n", start, end)
            end = newline + 1 if newline > start else end
        total, pieces = total + count(text[start:end]), pieces + 1
        if total - CUT_SLACK_TOKENS * (pieces - 1) >= limit:
            return True
        start = end
    return False


def _composes_only(normalizer: dict) -> bool:
    """Whether `normalizer` only applies Unicode normal forms (and lowercasing), which shrink a
    text by at most _NORMALIZED_CHARS_PER_CHAR; a Replace or Strip may shrink it without end."""
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_composes_only(n) for n in normalizer.get("normalizers", []))
    return kind in ("NFC", "NFKC", "NFD", "NFKD", "Lowercase")


class BodyLimit:
    """ASGI middleware: a request whose body is over `max_bytes` gets 413 (OpenAI error object)
    before the route runs. A declared Content-Length over the cap is refused without reading
    the body; otherwise the body is read here (as the route would: FastAPI buffers it whole),
    counted as it arrives and refused at the first chunk past the cap, then replayed to the
    route. After the body the route's receive is the server's (it waits for a disconnect).
    A body that stops arriving gets 408 (BODY_IDLE_SECONDS, BODY_MAX_SECONDS).
    A refusal first drops what the client is still sending, within DRAIN_MAX_BYTES and
    DRAIN_MAX_SECONDS (not when it waits for 100-continue).
    A POST whose Content-Encoding names a coding other than identity (a gzipped body) gets 415
    without its body being kept (refused as a 413 is: the routes parse the body as sent, and
    would call compressed JSON "not valid UTF-8")."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_bytes}")
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        coding = _content_coding(scope) if scope["method"] == "POST" else None
        if coding is not None:
            await _unsupported_coding(scope, receive, send, coding)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        chunks, seen = [], 0
        deadline = time.monotonic() + BODY_MAX_SECONDS
        while True:
            wait = min(BODY_IDLE_SECONDS, deadline - time.monotonic())
            try:
                message = await asyncio.wait_for(receive(), max(wait, 0.0))
            except asyncio.TimeoutError:
                await _timed_out(scope, receive, send, seen)
                return
            if message["type"] != "http.request":  # the client left while sending
                return
            chunks.append(message.get("body", b""))
            seen += len(chunks[-1])
            if seen > self.max_bytes:
                chunks.clear()
                await self._refuse(scope, receive, send, None)
                return
            if not message.get("more_body", False):
                break
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        del chunks
        replayed = False

        async def replay() -> Message:
            nonlocal replayed, body
            if replayed:
                return await receive()
            replayed = True
            message, body = {"type": "http.request", "body": body, "more_body": False}, b""
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send,
                      declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else f"over {self.max_bytes} bytes"
        logger.info("%s %s -> 413: body of %s", scope.get("method"), scope.get("path"), size)
        await _refuse_unread(scope, receive, send, error_response(
            413, f"the request body is {size}; this server accepts at most {self.max_bytes} "
                 "bytes (--max-request-bytes)", code="request_too_large"))


async def _refuse_unread(scope: Scope, receive: Receive, send: Send,
                         response: Response) -> None:
    """Send `response` (with Connection: close) to a request whose body is refused unread,
    after dropping what the client is still sending (_drain; not when it waits for
    100-continue: then the body is not on its way)."""
    if not _expects_continue(scope):
        await _drain(receive)
    # the client may still be sending: close the connection rather than read the rest
    response.headers["Connection"] = "close"
    await response(scope, receive, send)


async def _timed_out(scope: Scope, receive: Receive, send: Send, seen: int) -> None:
    logger.info("%s %s -> 408: %d body bytes, then nothing for %g s (or %g s in all)",
                scope.get("method"), scope.get("path"), seen, BODY_IDLE_SECONDS,
                BODY_MAX_SECONDS)
    response = error_response(
        408, f"the request body stopped arriving after {seen} bytes (at most "
             f"{BODY_IDLE_SECONDS:g} s between bytes and {BODY_MAX_SECONDS:g} s in all)",
        code="request_timeout", headers={"Connection": "close"})
    await response(scope, receive, send)


async def _unsupported_coding(scope: Scope, receive: Receive, send: Send,
                               coding: str) -> None:
    logger.info("%s %s -> 415: Content-Encoding %s", scope.get("method"), scope.get("path"),
                coding)
    # Accept-Encoding on a 415 names the codings a request may use (RFC 9110, 15.5.16)
    await _refuse_unread(scope, receive, send, error_response(
        415, f"Content-Encoding {coding!r} is not supported: send the request body "
             "uncompressed (no Content-Encoding, or identity)", param="Content-Encoding",
        code="unsupported_content_encoding", headers={"Accept-Encoding": "identity"}))


async def _drain(receive: Receive) -> None:
    """Read and drop the rest of a request body, up to DRAIN_MAX_BYTES or DRAIN_MAX_SECONDS."""
    seen, deadline = 0, time.monotonic() + DRAIN_MAX_SECONDS
    while seen <= DRAIN_MAX_BYTES:
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            message = await asyncio.wait_for(receive(), left)
        except asyncio.TimeoutError:
            return
        if message["type"] != "http.request" or not message.get("more_body", False):
            return
        seen += len(message.get("body", b""))


def _expects_continue(scope: Scope) -> bool:
    return any(name == b"expect" and value.lower() == b"100-continue"
               for name, value in scope.get("headers", ()))


def _content_coding(scope: Scope) -> str | None:
    """The first content coding other than identity that the request's Content-Encoding
    headers name (a comma-separated list each, any case), lowercase; None when there is none
    (the body is sent as is)."""
    for name, value in scope.get("headers", ()):
        if name == b"content-encoding":
            for coding in value.decode("latin-1").split(","):
                coding = coding.strip().lower()
                if coding and coding != "identity":
                    return coding
    return None


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the server (h11, httptools) refuses a malformed one itself
    return None
