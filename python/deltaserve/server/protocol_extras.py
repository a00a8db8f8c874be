"""OpenAI wire shapes of logprobs and tool calls (responses and stream deltas).

Logprobs are natural logs; -inf (a token the grammar masked) is sent as -9999.0, as vLLM does,
since JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel

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
