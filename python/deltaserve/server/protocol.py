"""OpenAI wire format: request models and the error object (responses: responses.py).

Requests accept the OpenAI fields plus the vLLM sampling extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, guided_json, guided_regex). Fields the engine
cannot honour (echo, suffix, non-text content, tool_choice "required" or a named
function, and vLLM's other extensions that would change the output: `VLLM_UNSUPPORTED`) are
rejected with `InvalidRequest`, never silently ignored. Other unknown fields are ignored, as
vLLM does.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
)

from deltaserve.core import MAX_LOGPROBS, SamplingParams
from deltaserve.server.limits import MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_TOKEN_IDS
from deltaserve.server.responses import _now
from deltaserve.server.structured import response_format_kind
from deltaserve.server.tool_requests import check_tools, history_calls


class InvalidRequest(Exception):
    """A request the server refuses: becomes an OpenAI error object with `status`."""

    def __init__(self, message: str, param: str | None = None, *, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)

    def to_error(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The OpenAI error body: {"error": {"message", "type", "param", "code"}}."""

    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    # vLLM's extension: with include_usage, every chunk also carries the usage so far
    continuous_usage_stats: StrictBool = False


# vLLM request extensions deltaserve does not implement; set to anything but their default
# (null, false, 0, empty) they would change the output, so they are a 400, not ignored.
VLLM_UNSUPPORTED = ("min_tokens", "use_beam_search", "include_stop_str_in_output",
                    "allowed_token_ids", "bad_words", "prompt_logprobs", "truncate_prompt_tokens",
                    "guided_choice", "guided_grammar",
                    "structured_outputs", "logits_processors")
VLLM_DETOKENIZE_UNSUPPORTED = ("skip_special_tokens", "spaces_between_special_tokens")
# and on chat (vLLM's chat extensions): the prompt as rendered here would differ from theirs
VLLM_CHAT_UNSUPPORTED = ("echo", "chat_template", "continue_final_message")
# OpenAI's legacy function-calling fields (before `tools`)
TOOL_FIELDS = ("functions", "function_call")
MAX_N = 128  # OpenAI's bound on n
UNSET = (None, False, 0, "", [], {})  # an extension at its default: changes nothing


def refuse_set_extras(extra: dict[str, Any], names: tuple[str, ...], note: str = "",
                      unset: tuple[Any, ...] = UNSET) -> None:
    """Raise InvalidRequest (param: the field) for the first of `names` that `extra` (a
    request's unknown fields) sets to anything but `unset`."""
    for name in names:
        if extra.get(name) not in unset:
            raise InvalidRequest(f"{name} is not supported by deltaserve{note}", name)


class _GenerationRequest(BaseModel):
    """Fields shared by completions and chat completions. None means "the default". Numbers
    are strict: a JSON string ("3") or boolean (true) where a number belongs is a 400, as in
    OpenAI's API, never silently 3 or 1; an integer is accepted where a float belongs."""

    model_config = ConfigDict(extra="allow")  # extras land in model_extra, checked below

    model: str | None = None
    max_tokens: StrictInt | None = None
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: StrictBool = False  # JSON true/false only: "yes" or 1 is a 400, not True
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt | None = None
    logit_bias: dict[str, StrictFloat] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    user: str | None = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and self.stream_options.continuous_usage_stats

    def check_supported(self) -> None:
        """Raise InvalidRequest for fields the engine cannot honour."""
        if self.n is not None and not 1 <= self.n <= MAX_N:
            raise InvalidRequest(f"n must be in [1, {MAX_N}]", "n")
        if self.logit_bias:
            raise InvalidRequest("logit_bias is not supported by deltaserve", "logit_bias")
        refuse_set_extras(self.model_extra or {}, VLLM_UNSUPPORTED)
        # vLLM's detokenizer options whose default is true: false would change the text
        refuse_set_extras(self.model_extra or {}, VLLM_DETOKENIZE_UNSUPPORTED,
                          unset=(None, True))
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true",
                                 "stream_options")

    def logprob_count(self) -> int | None:
        """SamplingParams.logprobs: None (off) or how many top tokens to return per token."""
        return None

    def num_samples(self) -> int:
        """Choices to generate: n, or best_of (completions) to return the n best of."""
        return self.n or 1

    def stop_list(self) -> list[str]:
        """`stop` as a list (OpenAI takes one string or a list)."""
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def max_tokens_param(self) -> tuple[int | None, str]:
        """The requested output budget and the field name it came from."""
        return self.max_tokens, "max_tokens"

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams with OpenAI defaults for unset fields; raises InvalidRequest."""
        values = {
            "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty, **self.extension_params(),
        }
        try:
            params = SamplingParams(
                max_tokens=max_tokens, seed=self.seed, stop=self.stop_list(),
                stop_token_ids=list(self.stop_token_ids or []), ignore_eos=self.ignore_eos,
                **{k: v for k, v in values.items() if v is not None})
        except ValueError as e:
            field = str(e).split(" ", 1)[0]
            if field == "max_tokens":
                field = self.max_tokens_param()[1]
            raise InvalidRequest(str(e).replace("max_tokens", field, 1), field) from e
        return params

    def extension_params(self) -> dict[str, Any]:
        """SamplingParams fields set by this endpoint's deltaserve extensions (None: unset)."""
        return {}


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `prompt`: text, token ids, or a one-element list of either."""

    prompt: str | list[StrictInt] | list[str] | list[list[StrictInt]]
    logprobs: StrictInt | None = None
    echo: StrictBool = False
    best_of: StrictInt | None = None
    suffix: str | None = None
    # deltaserve's extension (SamplingParams.token_healing; `deltaserve generate` heals by
    # default, the server completes the prompt exactly as sent unless asked)
    token_healing: StrictBool = False

    def extension_params(self) -> dict[str, Any]:
        return {"token_healing": self.token_healing}

    def logprob_count(self) -> int | None:
        if self.logprobs is None and self.num_samples() > (self.n or 1):
            return 0  # best_of ranks the samples by their summed logprobs
        return self.logprobs

    def num_samples(self) -> int:
        return self.best_of or self.n or 1

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}]", "logprobs")
        if self.echo:
            raise InvalidRequest("echo is not supported by deltaserve", "echo")
        if self.best_of is not None and not (self.n or 1) <= self.best_of <= MAX_N:
            raise InvalidRequest(f"best_of must be in [n, {MAX_N}]", "best_of")
        if self.best_of not in (None, self.n or 1) and self.stream:
            raise InvalidRequest("best_of > n cannot be streamed (as in OpenAI's API)",
                                 "best_of")
        if self.suffix:
            raise InvalidRequest("suffix is not supported by deltaserve", "suffix")
        if isinstance(self.prompt, list) and (not self.prompt or self.prompt[0] == []):
            raise InvalidRequest("prompt must not be empty", "prompt")
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], (str, list)) \
                and len(self.prompt) != 1:
            raise InvalidRequest("batched prompts are not supported: send a string, a list of "
                                 "token ids, or a list of exactly one of either", "prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (checked in check_supported)
    tool_call_id: str | None = None  # a tool message: the call it answers
    function_call: Any | None = None

    def text(self, index: int) -> str:
        """The message's text. Raises InvalidRequest for non-text content parts, a text part
        without text, and missing content (null, absent or an empty list of parts) on any role
        but assistant (OpenAI lets only an assistant message leave content out)."""
        param = f"messages.{index}.content"
        if self.content is None or self.content == []:
            if self.role != "assistant":
                raise InvalidRequest(f"a {self.role} message needs content", param)
            return ""
        if isinstance(self.content, str):
            return self.content
        for part in self.content:
            if part.type != "text":
                raise InvalidRequest(f"content part type {part.type!r} is not supported: only "
                                     "text parts", param)
            if part.text is None:
                raise InvalidRequest("a text content part needs a 'text' string", param)
        return "".join(part.text for part in self.content)


# apply_chat_template's own arguments, and "messages", which it passes to the template's
# render itself: in chat_template_kwargs they collide with the call
TEMPLATE_CALL_ARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                "add_generation_prompt", "continue_final_message", "tokenize",
                                "padding", "truncation", "max_length", "return_tensors",
                                "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})


class ChatCompletionRequest(_GenerationRequest):
    """POST /v1/chat/completions."""

    messages: list[ChatMessage] = Field(max_length=MAX_MESSAGES)
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool | None = None
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None  # "none" or "auto" (see tool_requests)
    response_format: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}

    def check_supported(self) -> None:
        super().check_supported()
        if not self.messages:
            raise InvalidRequest("messages must contain at least one message", "messages")
        if self.top_logprobs is not None:
            if not 0 <= self.top_logprobs <= MAX_LOGPROBS:
                raise InvalidRequest(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                     f"{self.top_logprobs}", "top_logprobs")
            if not self.logprobs:
                raise InvalidRequest("top_logprobs needs logprobs: true", "top_logprobs")
        extra = self.model_extra or {}
        refuse_set_extras(extra, TOOL_FIELDS, " (use tools and tool_choice)")
        check_tools(self)
        for i, m in enumerate(self.messages):
            if m.function_call:
                raise InvalidRequest("function_call in chat history is not supported by "
                                     "deltaserve (use tool_calls)", f"messages.{i}.function_call")
        response_format_kind(self.response_format)
        refuse_set_extras(extra, VLLM_CHAT_UNSUPPORTED)
        refuse_set_extras(extra, ("token_healing",), " on chat (a /v1/completions parameter: "
                          "the chat template's end is no place to heal)")
        if extra.get("best_of") not in (None, self.n or 1):  # it was ignored (a fresh user)
            raise InvalidRequest("best_of is a /v1/completions parameter; chat completions "
                                 "return n choices", "best_of")
        if extra.get("add_generation_prompt", True) is not True:
            raise InvalidRequest("add_generation_prompt must be true: deltaserve always ends "
                                 "the rendered chat with the assistant's turn",
                                 "add_generation_prompt")
        reserved = sorted(set(self.chat_template_kwargs or {}) & TEMPLATE_CALL_ARGS)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {reserved[0]!r}: it is an "
                                 "argument of the template call itself, not a template variable",
                                 "chat_template_kwargs")

    def logprob_count(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def max_tokens_param(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them (developer is sent as system; an
        assistant turn's tool calls with their arguments decoded, as the Qwen templates read
        them; a tool message with its tool_call_id)."""
        out = []
        for i, m in enumerate(self.messages):
            msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                   "content": m.text(i)}
            if m.tool_calls:
                msg["tool_calls"] = history_calls(m.tool_calls, i)
            if m.tool_call_id is not None:
                msg["tool_call_id"] = m.tool_call_id
            out.append(msg)
        return out


# ---------------------------------------------------------------------------------------------
# Responses


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "deltaserve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
