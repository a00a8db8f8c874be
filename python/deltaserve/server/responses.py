"""OpenAI response shapes: usage, choices, stream chunks, logprobs and tool calls.

Logprobs are natural logs; -inf (a token the grammar masked) is sent as -9999.0, as vLLM does,
since JSON has no infinity.
"""

from __future__ import annotations

import math
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

LOGPROB_FLOOR = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    """One output token of a chat choice: itself and its row's most likely tokens."""

    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per output token."""

    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, encoded


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaToolCall(ToolCall):
    """A streamed tool call: sent whole, once its block is complete (OpenAI clients
    concatenate `arguments` over deltas of one `index`, so one delta is a valid stream)."""

    index: int


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    """Token counts; `prompt_tokens_details.cached_tokens` = prompt tokens from the prefix cache."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails

    @classmethod
    def of(cls, prompt: int, completion: int, cached: int) -> Usage:
        return cls(prompt_tokens=prompt, completion_tokens=completion,
                   total_tokens=prompt + completion,
                   prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))


def _now() -> int:
    return int(time.time())


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Envelope(BaseModel):
    """What every completion response and chunk carries."""

    id: str
    created: int = Field(default_factory=_now)
    model: str


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class CompletionResponse(_Envelope):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class _ChatChoiceBase(BaseModel):
    index: int = 0
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class ChatChoice(_ChatChoiceBase):
    message: AssistantMessage


class ChatCompletionResponse(_Envelope):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class DeltaMessage(BaseModel):
    """A streamed message delta; unset fields are left out, as OpenAI sends them."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None

    @model_serializer(mode="wrap")
    def _drop_unset(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class ChatChunkChoice(_ChatChoiceBase):
    delta: DeltaMessage


class ChatCompletionChunk(_Envelope):
    """One SSE event of a streamed chat completion (the usage chunk has no choices)."""

    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
