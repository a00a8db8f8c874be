"""Completions and chat completions on top of AsyncEngine: prompt preparation, request
validation, non-streaming collection and SSE streaming."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import Request
from fastapi.responses import StreamingResponse

from deltaserve.server.async_engine import AsyncEngine, EngineDeadError, RequestStream
from deltaserve.server.limits import chars_per_token_bound
from deltaserve.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    InvalidRequest,
    Usage,
    _GenerationRequest,
    new_id,
)

if TYPE_CHECKING:
    from pydantic import BaseModel

    from deltaserve.engine.llm_engine import RequestOutput
    from deltaserve.server.metrics import ServerMetrics

logger = logging.getLogger("deltaserve.server")


def sse(payload: BaseModel | dict) -> str:
    """One server-sent event carrying `payload` as JSON."""
    data = payload if isinstance(payload, dict) else payload.model_dump(mode="json")
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


async def _until_disconnect(request: Request, stream: RequestStream) -> None:
    """Abort `stream` when the client goes away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
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
        return list(self._tokenizer("prompt").encode(text))

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
                messages, tokenize=False, add_generation_prompt=True,
                **(body.chat_template_kwargs or {}))
        except Exception as e:  # jinja raises TemplateError for conversations it refuses
            raise InvalidRequest(f"the chat template rejected the messages: {e}",
                                 "messages") from e
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

    async def _start(self, rid: str, body: _GenerationRequest, prompt_ids: list[int],
                     prompt_param: str, default_max_tokens: int | None) -> RequestStream:
        params = self.sampling_params(body, prompt_ids, prompt_param, default_max_tokens)
        try:
            stream = await self.engine.add(prompt_ids, params)
            logger.info("%s: %d prompt tokens, max_tokens %d, temperature %g%s (engine rid %d)",
                        rid, len(prompt_ids), params.max_tokens, params.temperature,
                        ", streaming" if body.stream else "", stream.rid)
            return stream
        except ValueError as e:  # the engine's own checks (vocabulary, context, params)
            message = str(e)
            param = message.split(" ", 1)[0]
            if param not in type(body).model_fields:
                param = prompt_param
            raise InvalidRequest(message, param) from e

    # -- endpoints ---------------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, request: Request):
        return await self._serve(body, request, "completions", "cmpl", self.completion_prompt,
                                 "prompt", 16, self._completion_chunks,
                                 self._completion_response)

    async def chat(self, body: ChatCompletionRequest, request: Request):
        return await self._serve(body, request, "chat", "chatcmpl", self.chat_prompt,
                                 "messages", None, self._chat_chunks, self._chat_response)

    async def _serve(self, body: _GenerationRequest, request: Request, endpoint: str,
                     id_prefix: str, prompt, prompt_param: str, default_max_tokens: int | None,
                     chunks, respond):
        """Check, tokenize, start; then an SSE stream of `chunks(rid, out, first)`, or the
        collected text turned into a response by `respond(rid, text, last)`. Raises
        InvalidRequest (400/404) before anything runs, ClientGone when the client leaves."""
        body.check_supported()
        self.check_model(body.model)
        for stop in body.stop_list():
            self._check_encodable(stop, "stop")
        rid = new_id(id_prefix)
        # tokenizing a long prompt must not stall the event loop (other clients, /health)
        ids = await asyncio.to_thread(prompt, body)
        stream = await self._start(rid, body, ids, prompt_param, default_max_tokens)
        if body.stream:
            return self._streaming(rid, endpoint, body, stream, chunks)
        text, last = await self._collect(rid, endpoint, stream, request)
        self._finished(rid, endpoint, last)
        return respond(rid, text, last)

    def _completion_response(self, rid: str, text: str, last: RequestOutput) -> CompletionResponse:
        return CompletionResponse(
            id=rid, model=self.engine.model_name,
            choices=[CompletionChoice(text=text, finish_reason=last.finish_reason)],
            usage=_usage(last))

    def _chat_response(self, rid: str, text: str, last: RequestOutput) -> ChatCompletionResponse:
        return ChatCompletionResponse(
            id=rid, model=self.engine.model_name,
            choices=[ChatChoice(message=AssistantMessage(content=text),
                                finish_reason=last.finish_reason)],
            usage=_usage(last))

    # -- output --------------------------------------------------------------------------------

    async def _collect(self, rid: str, endpoint: str, stream: RequestStream,
                       request: Request) -> tuple[str, RequestOutput]:
        """All of the request's text and its last output; aborts if the client leaves."""
        watcher = asyncio.create_task(_until_disconnect(request, stream))
        try:
            parts, last = [], None
            async for out in stream:
                parts.append(out.new_text)
                last = out
        finally:
            watcher.cancel()
        if last is None or not last.finished:
            self._aborted(rid, endpoint)
            raise ClientGone()
        return "".join(parts), last

    def _streaming(self, rid: str, endpoint: str, body: _GenerationRequest,
                   stream: RequestStream, chunks) -> StreamingResponse:
        """SSE response: `chunks(rid, out, first)` per output, then usage, then [DONE]."""
        model = self.engine.model_name
        chunk_type = ChatCompletionChunk if endpoint == "chat" else CompletionResponse

        async def events() -> AsyncIterator[str]:
            last, stopped = None, False
            try:
                async for out in stream:
                    for chunk in chunks(rid, out, first=last is None):
                        yield sse(chunk)
                    last = out
                if body.include_usage and last is not None:
                    yield sse(chunk_type(id=rid, model=model, choices=[], usage=_usage(last)))
            except Exception as e:  # headers are sent: report in-band, then end the stream
                stopped = isinstance(e, EngineDeadError)  # the server is stopping, not a bug
                if stopped:
                    logger.info("request %s ended: %s", rid, e)
                else:
                    logger.exception("request %s failed mid-stream", rid)
                self.metrics.errors.labels(status="503" if stopped else "500").inc()
                message = str(e) if stopped else f"internal error: {e}"
                yield sse({"error": {"message": message, "type": "server_error",
                                     "param": None, "code": None}})
            finally:
                stream.abort()  # no-op once finished; frees pages/slots if the client left
                if not stopped and (last is None or not last.finished):
                    self._aborted(rid, endpoint)
            if last is not None and last.finished:
                self._finished(rid, endpoint, last)
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    def _completion_chunks(self, rid: str, out: RequestOutput,
                           first: bool) -> list[CompletionResponse]:
        if not (out.new_text or out.finished):
            return []
        return [CompletionResponse(id=rid, model=self.engine.model_name, choices=[
            CompletionChoice(text=out.new_text, finish_reason=out.finish_reason)])]

    def _chat_chunks(self, rid: str, out: RequestOutput, first: bool) -> list[ChatCompletionChunk]:
        deltas = []
        if first:
            deltas.append((DeltaMessage(role="assistant", content=""), None))
        if out.new_text:
            deltas.append((DeltaMessage(content=out.new_text), None))
        if out.finished:
            deltas.append((DeltaMessage(), out.finish_reason))
        return [ChatCompletionChunk(id=rid, model=self.engine.model_name, choices=[
            ChatChunkChoice(delta=delta, finish_reason=reason)]) for delta, reason in deltas]

    def _finished(self, rid: str, endpoint: str, out: RequestOutput) -> None:
        self.metrics.observe_finished(endpoint, out)
        logger.info("%s %s: %d prompt tokens (%d cached), %d completion tokens, finish %s",
                    endpoint, rid, out.prompt_tokens, out.cached_tokens, out.completion_tokens,
                    out.finish_reason)

    def _aborted(self, rid: str, endpoint: str) -> None:
        self.metrics.requests.labels(endpoint=endpoint, finish_reason="abort").inc()
        logger.info("%s %s: client gone before the request finished; aborted", endpoint, rid)


class ClientGone(Exception):
    """The client disconnected before its request finished (the request was aborted)."""


def _usage(out: RequestOutput) -> Usage:
    return Usage.of(out.prompt_tokens, out.completion_tokens, out.cached_tokens)

