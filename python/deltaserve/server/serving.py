"""Completions and chat completions on top of AsyncEngine: prompt preparation, request
validation, non-streaming collection and SSE streaming."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from deltaserve.config import valid_seed
from deltaserve.core import SamplingParams
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from deltaserve.server.errors import error_object
from deltaserve.server.limits import chars_per_token_bound, reaches_token_limit
from deltaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    _GenerationRequest,
)
from deltaserve.server.render import ChatRenderer, Choice, CompletionRenderer, usage
from deltaserve.server.responses import ChatCompletionChunk, CompletionResponse, new_id
from deltaserve.server.structured import grammar_spec
from deltaserve.server.tool_requests import parses_tool_calls

if TYPE_CHECKING:
    from pydantic import BaseModel

    from deltaserve.engine.llm_engine import RequestOutput
    from deltaserve.server.metrics import ServerMetrics

logger = logging.getLogger("deltaserve.server")


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    data = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request, streams: list[RequestStream]) -> None:
    """Abort `streams` when the client goes away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
    for stream in streams:
        stream.abort()


class OpenAIServing:
    """Turns OpenAI requests into engine requests and engine outputs into OpenAI responses."""

    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics) -> None:
        self.engine = engine
        self.metrics = metrics

    @functools.cached_property
    def chars_per_token(self) -> int:
        """limits.chars_per_token_bound of the tokenizer: one pass over the vocabulary, once."""
        return chars_per_token_bound(self._tokenizer("prompt"))

    # -- preparation -------------------------------------------------------------------------

    def check_model(self, model: str | None, *, default_ok: bool = True) -> None:
        """Raise InvalidRequest (404, model_not_found) unless `model` is the served model's id,
        or None / empty where `default_ok` (a request body may leave its model out)."""
        if (model or not default_ok) and model != self.engine.model_name:
            raise InvalidRequest(f"The model `{model}` does not exist; this server serves "
                                 f"`{self.engine.model_name}`", "model", status=404,
                                 code="model_not_found")

    def _tokenizer(self, param: str):
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise InvalidRequest("the model has no tokenizer: send the prompt as token ids",
                                 param)
        return tokenizer

    def completion_prompt(self, body: CompletionRequest) -> list[int]:
        prompt = body.prompt
        if isinstance(prompt, list) and isinstance(prompt[0], list):  # [[ids]]: one prompt
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
            return list(prompt)
        text = prompt if isinstance(prompt, str) else prompt[0]
        self._check_text_size(len(text), "prompt")
        self._check_encodable(text, "prompt")
        self._check_token_count(text, "prompt")
        return list(self._tokenizer("prompt").encode(text))

    def _check_token_count(self, text: str, param: str) -> None:
        """Refuse a long text whose tokens surely reach the context, counted in pieces
        (limits.reaches_token_limit) before it is tokenized whole."""
        limit = self.engine.max_model_len
        if reaches_token_limit(self._tokenizer(param), text, limit):
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"more (counted in pieces: {len(text)} characters); at most {limit - 1} prompt "
                f"tokens fit, leaving room for one completion token", param,
                code="context_length_exceeded")

    @staticmethod
    def _check_encodable(text: str, param: str) -> None:
        """JSON may carry lone UTF-16 surrogates ("\\ud800"), which no tokenizer accepts."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise InvalidRequest(f"the text is not valid Unicode: {e.reason} at character "
                                 f"{e.start} (a lone UTF-16 surrogate?)", param) from e

    def _check_text_size(self, n_chars: int, param: str) -> None:
        """Refuse text that cannot fit the context whatever it tokenizes to (no token covers
        more than `chars_per_token` characters: limits.chars_per_token_bound), before spending
        time on it."""
        limit = self.engine.max_model_len * self.chars_per_token
        if n_chars > limit:
            raise InvalidRequest(
                f"the prompt has {n_chars} characters; this model's context of "
                f"{self.engine.max_model_len} tokens cannot hold more than {limit}", param,
                code="context_length_exceeded")

    def chat_prompt(self, body: ChatCompletionRequest) -> list[int]:
        tokenizer = self._tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequest("the model's tokenizer has no chat template: use "
                                 "/v1/completions", "messages")
        messages = body.template_messages()
        self._check_text_size(sum(len(str(m.get("content") or "")) for m in messages),
                              "messages")
        for m in messages:
            self._check_encodable(str(m.get("content") or ""), "messages")
        try:
            text = tokenizer.apply_chat_template(
                messages, tools=body.tools or None, tokenize=False, add_generation_prompt=True,
                **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja raises TemplateError for conversations it refuses
            raise InvalidRequest(f"the chat template rejected the messages: {e}",
                                 "messages") from e
        self._check_token_count(text, "messages")
        return list(tokenizer.encode(text, add_special_tokens=False))

    def sampling_params(self, body: _GenerationRequest, prompt_ids: list[int], prompt_param: str,
                        default_max_tokens: int | None):
        """Check the context limit and build SamplingParams (raises InvalidRequest)."""
        limit, n_prompt = self.engine.max_model_len, len(prompt_ids)
        if n_prompt == 0:
            raise InvalidRequest("the prompt must contain at least one token", prompt_param)
        if n_prompt >= limit:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{n_prompt} tokens; at most {limit - 1} prompt tokens fit, leaving room for one "
                f"completion token",
                prompt_param, code="context_length_exceeded")
        room = limit - n_prompt
        max_tokens, param = body.max_tokens_param()
        if max_tokens is None:
            # unset: up to what the context and the KV pool can hold (pages are reserved at
            # admission, so a default larger than the pool would refuse the request)
            room = min(room, max(1, self.engine.max_request_len - n_prompt))
            max_tokens = room if default_max_tokens is None else min(default_max_tokens, room)
        elif max_tokens > room:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, but "
                f"{n_prompt + max_tokens} were requested ({n_prompt} in the prompt, "
                f"{max_tokens} for the completion): "
                f"reduce {param} to at most {room}", param, code="context_length_exceeded")
        return body.to_sampling_params(max_tokens)

    def _params(self, body: _GenerationRequest, prompt_ids: list[int], prompt_param: str,
                default_max_tokens: int | None) -> tuple[list[SamplingParams], str | None]:
        """One SamplingParams per choice (choice i samples with seed + i when a seed is given,
        so choice i equals a single request with that seed) and the field that set the
        grammar (None without one)."""
        params = self.sampling_params(body, prompt_ids, prompt_param, default_max_tokens)
        params.logprobs = body.logprob_count()
        params.structured, spec_param = grammar_spec(body)
        n = body.num_samples()
        # checked before the copies are built: SamplingParams refuses such a seed itself, and
        # that ValueError would be a 500
        if params.seed is not None and not valid_seed(params.seed + n - 1):
            raise InvalidRequest("seed + n - 1 must stay in [-2**63, 2**64) (choice i "
                                 "samples with seed + i)", "seed")
        out = [params] + [replace(params, seed=None if params.seed is None else params.seed + i)
                          for i in range(1, n)]
        return out, spec_param

    async def _start(self, rid: str, body: _GenerationRequest, prompt_ids: list[int],
                     prompt_param: str, default_max_tokens: int | None) -> list[RequestStream]:
        params, spec_param = self._params(body, prompt_ids, prompt_param, default_max_tokens)
        try:
            if params[0].structured is not None:
                spec = await self.engine.prepare_grammar(params[0].structured)
                params = [replace(p, structured=spec) for p in params]
            if len(params) == 1:
                streams = [await self.engine.add(prompt_ids, params[0])]
            else:
                streams = await self.engine.add_forks(prompt_ids, params)
            p = params[0]
            logger.info("%s: %d prompt tokens, n %d, max_tokens %d, temperature %g%s (engine "
                        "rids %s)", rid, len(prompt_ids), len(params), p.max_tokens,
                        p.temperature, ", streaming" if body.stream else "",
                        [s.rid for s in streams])
            return streams
        except ValueError as e:  # the engine's own checks (vocabulary, context, params)
            message = str(e)
            param = message.split(" ", 1)[0]
            if message.startswith("structured output"):
                param = spec_param
            elif param not in type(body).model_fields:
                param = prompt_param
            raise InvalidRequest(message, param) from e

    # -- endpoints ---------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        renderer = CompletionRenderer(self.engine.tokenizer, self.engine.model_name,
                                      body.logprobs is not None, _token_ids(body))
        return await self._serve(body, request, "completions", "cmpl", self.completion_prompt,
                                 "prompt", 16, renderer)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        renderer = ChatRenderer(self.engine.tokenizer, self.engine.model_name,
                                bool(body.logprobs), _token_ids(body),
                                body.tools if parses_tool_calls(body) else None)
        return await self._serve(body, request, "chat", "chatcmpl", self.chat_prompt,
                                 "messages", None, renderer)

    async def _serve(self, body: _GenerationRequest, request: Request, endpoint: str,
                     id_prefix: str, prompt, prompt_param: str, default_max_tokens: int | None,
                     renderer):
        """Check, tokenize, start the n choices; then an SSE stream of the renderer's chunks,
        or the collected choices turned into a response by the renderer. Raises
        InvalidRequest (400/404) before anything runs, ClientGone when the client leaves."""
        body.check_supported()
        self.check_model(body.model)
        for stop in body.stop_list():
            self._check_encodable(stop, "stop")
        rid = new_id(id_prefix)
        # tokenizing a long prompt must not stall the event loop (other clients, /health)
        ids = await asyncio.to_thread(prompt, body)
        streams = await self._start(rid, body, ids, prompt_param, default_max_tokens)
        if body.stream:
            return self._streaming(rid, endpoint, body, streams, renderer)
        choices = await self._collect(rid, endpoint, streams, request, renderer)
        self._finished(rid, endpoint, choices)
        return renderer.response(rid, best(choices, body.n or 1), usage(choices))

    # -- output --------------------------------------------------------------------------------

    async def _collect(self, rid: str, endpoint: str, streams: list[RequestStream],
                       request: Request, renderer) -> list[Choice]:
        """Every choice's outputs; aborts them all if the client leaves."""
        choices = [renderer.new_choice(i) for i in range(len(streams))]
        watchers = [asyncio.create_task(_until_disconnect(request, streams))]
        try:
            async for i, out in _merged(streams):
                choices[i].add(out)
        finally:
            for w in watchers:
                w.cancel()
        if any(c.last is None or not c.last.finished for c in choices):
            for s in streams:
                s.abort()
            self._aborted(rid, endpoint)
            raise ClientGone()
        return choices

    def _streaming(self, rid: str, endpoint: str, body: _GenerationRequest,
                   streams: list[RequestStream], renderer) -> StreamingResponse:
        """SSE response: the renderer's chunks per output, then usage, then [DONE]."""
        model = self.engine.model_name
        chunk_type = ChatCompletionChunk if endpoint == "chat" else CompletionResponse
        choices = [renderer.new_choice(i) for i in range(len(streams))]

        def done() -> bool:
            return all(c.last is not None and c.last.finished for c in choices)

        async def events() -> AsyncIterator[str]:
            stopped = False
            try:
                async for i, out in _merged(streams):
                    for chunk in renderer.chunks(rid, choices[i], out):
                        if body.continuous_usage:
                            chunk.usage = usage(choices)
                        yield sse(chunk)
                if body.include_usage and done():
                    yield sse(chunk_type(id=rid, model=model, choices=[], usage=usage(choices)))
            except Exception as e:  # headers are sent: report in-band, then end the stream
                stopped = isinstance(e, EngineDeadError)  # the server is stopping, not a bug
                if stopped:
                    logger.info("request %s ended: %s", rid, e)
                else:
                    logger.exception("request %s failed mid-stream", rid)
                self.metrics.errors.labels(status="503" if stopped else "500").inc()
                message = str(e) if stopped else f"internal error: {e}"
                yield sse(error_object(message, "server_error"))
            finally:
                for s in streams:  # no-op once finished; frees pages/slots if the client left
                    s.abort()
                if not stopped and not done():  # the client left, or the server's shutdown
                    self._aborted(rid, endpoint, "the stream ended")  # cancelled the task
            if done():
                self._finished(rid, endpoint, choices)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _finished(self, rid: str, endpoint: str, choices: list[Choice]) -> None:
        for c in choices:
            self.metrics.observe_finished(endpoint, c.last)
        out = choices[0].last
        logger.info("%s %s: %d prompt tokens (%d cached), %d completion tokens, finish %s",
                    endpoint, rid, out.prompt_tokens, out.cached_tokens,
                    sum(c.last.completion_tokens for c in choices),
                    [c.last.finish_reason for c in choices])

    def _aborted(self, rid: str, endpoint: str, why: str = "client gone") -> None:
        self.metrics.requests.labels(endpoint=endpoint, finish_reason="abort").inc()
        logger.info("%s %s: %s before the request finished; aborted", endpoint, rid, why)


def best(choices: list[Choice], n: int) -> list[Choice]:
    """The n choices of highest summed logprob (best_of, as vLLM ranks them), re-indexed in
    that order; all of them, as they are, when there are only n."""
    if len(choices) == n:
        return choices
    ranked = sorted(choices, key=lambda c: -sum(e.logprob for e in c.logprobs))[:n]
    for i, c in enumerate(ranked):
        c.index = i
    return ranked


def _token_ids(body: _GenerationRequest) -> bool:
    """vLLM's `return_tokens_as_token_ids`: logprob tokens as "token_id:N"."""
    return (body.model_extra or {}).get("return_tokens_as_token_ids") is True


class ClientGone(Exception):
    """The client disconnected before its request finished (the request was aborted)."""


async def _merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every stream as they come; ends when every stream ended
    (finished or aborted); a stream's error is raised."""
    if len(streams) == 1:
        async for out in streams[0]:
            yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for out in stream:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        left = len(streams)
        while left:
            i, item = await queue.get()
            if item is None:
                left -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
