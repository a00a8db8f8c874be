"""Engine outputs -> OpenAI choices: text, logprobs and tool calls, whole or as stream chunks.

One renderer per endpoint keeps per-choice state (`Choice`): the text so far, the logprob
entries, the completions text offset, the chat tool-call stream parser. Token strings in
logprobs are each token decoded on its own (a token holding part of a UTF-8 character shows
as U+FFFD; its `bytes` are of that text), or "token_id:N" with vLLM's
`return_tokens_as_token_ids` (and for a model without a tokenizer). A completions token's
`text_offset` is where its text starts in the returned text, from the engine
(engine/logprobs.py TextOffsets), so streamed and whole responses give the same offsets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltaserve.server.responses import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    TopLogprob,
    Usage,
    finite,
)
from deltaserve.server.tool_calls import ParsedCall, ToolStreamParser, parse_tool_calls

if TYPE_CHECKING:
    from deltaserve.engine.llm_engine import RequestOutput
    from deltaserve.engine.logprobs import TokenLogprob


@dataclass
class Choice:
    """What one choice has produced so far."""

    index: int
    parts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    last: RequestOutput | None = None
    text_offset: int = 0  # completions: characters streamed so far
    parser: ToolStreamParser | None = None
    n_calls: int = 0  # chat: tool calls streamed so far

    def add(self, out: RequestOutput) -> None:
        self.parts.append(out.new_text)
        self.logprobs.extend(out.new_logprobs or [])
        self.last = out

    @property
    def text(self) -> str:
        return "".join(self.parts)


def usage(choices: list[Choice]) -> Usage:
    """One prompt (counted once), every choice's completion tokens: so far, while streaming
    (choices with no output yet count none). At least one choice has an output."""
    outs = [c.last for c in choices if c.last is not None]
    return Usage.of(outs[0].prompt_tokens, sum(o.completion_tokens for o in outs),
                    outs[0].cached_tokens)


class _Renderer:
    def __init__(self, tokenizer, model: str, want_logprobs: bool,
                 token_ids: bool = False) -> None:
        self.tokenizer, self.model, self.want_logprobs = tokenizer, model, want_logprobs
        self.token_ids = token_ids

    def token_text(self, token_id: int) -> str:
        if self.tokenizer is None or self.token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])


class CompletionRenderer(_Renderer):
    def logprobs(self, entries: list[TokenLogprob], offset: int) -> CompletionLogprobs:
        tokens = [self.token_text(e.token_id) for e in entries]
        offsets = []
        for e, t in zip(entries, tokens):  # the engine's offsets (TextOffsets) where it has text
            offsets.append(e.text_offset if e.text_offset is not None else offset)
            offset += len(t)
        return CompletionLogprobs(
            tokens=tokens, token_logprobs=[finite(e.logprob) for e in entries],
            top_logprobs=[self._top_with_chosen(e) for e in entries], text_offset=offsets)

    def _top_with_chosen(self, e: TokenLogprob) -> dict[str, float]:
        """The `logprobs` most likely tokens and, as the legacy API and vLLM give it, the
        sampled token too when it is not among them (so up to logprobs + 1 entries)."""
        top = {self.token_text(t): finite(v) for t, v in e.top}
        top.setdefault(self.token_text(e.token_id), finite(e.logprob))
        return top

    def new_choice(self, index: int) -> Choice:
        return Choice(index)

    def chunks(self, rid: str, choice: Choice, out: RequestOutput) -> list[CompletionResponse]:
        """The stream chunks of `out` (records it in `choice`)."""
        choice.add(out)
        entries = out.new_logprobs or []
        if not (out.new_text or out.finished or entries):
            return []
        lp = self.logprobs(entries, choice.text_offset) if self.want_logprobs else None
        choice.text_offset += len(out.new_text)
        return [CompletionResponse(id=rid, model=self.model, choices=[CompletionChoice(
            index=choice.index, text=out.new_text, finish_reason=out.finish_reason,
            logprobs=lp)])]

    def response(self, rid: str, choices: list[Choice], total: Usage) -> CompletionResponse:
        """The whole response; `total`: the usage of every sample (best_of counts them all)."""
        return CompletionResponse(id=rid, model=self.model, usage=total, choices=[
            CompletionChoice(index=c.index, text=c.text, finish_reason=c.last.finish_reason,
                             logprobs=self.logprobs(c.logprobs, 0) if self.want_logprobs
                             else None) for c in choices])


class ChatRenderer(_Renderer):
    """`tools`: the request's tools when their calls are parsed (tool_choice not "none")."""

    def __init__(self, tokenizer, model: str, want_logprobs: bool, token_ids: bool,
                 tools: list[dict[str, Any]] | None) -> None:
        super().__init__(tokenizer, model, want_logprobs, token_ids)
        self.tools = tools

    def _top(self, token_id: int, logprob: float) -> dict[str, Any]:
        text = self.token_text(token_id)
        return {"token": text, "logprob": finite(logprob), "bytes": list(text.encode())}

    def logprobs(self, entries: list[TokenLogprob]) -> ChatLogprobs:
        return ChatLogprobs(content=[
            ChatTokenLogprob(**self._top(e.token_id, e.logprob),
                             top_logprobs=[TopLogprob(**self._top(t, v)) for t, v in e.top])
            for e in entries])

    def new_choice(self, index: int) -> Choice:
        return Choice(index, parser=ToolStreamParser(self.tools) if self.tools else None)

    def chunks(self, rid: str, choice: Choice, out: RequestOutput) -> list[ChatCompletionChunk]:
        """The stream chunks of `out` (records it in `choice`)."""
        deltas: list[tuple[DeltaMessage, str | None, ChatLogprobs | None]] = []
        if choice.last is None:
            deltas.append((DeltaMessage(role="assistant", content=""), None, None))
        text, calls = out.new_text, []
        if choice.parser is not None:
            text, calls = choice.parser.feed(text)
            if out.finished:
                text += choice.parser.finish()
        entries = out.new_logprobs or []
        lp = self.logprobs(entries) if self.want_logprobs and entries else None
        if text or lp is not None:
            deltas.append((DeltaMessage(content=text), None, lp))
        for call in calls:
            deltas.append((DeltaMessage(tool_calls=[DeltaToolCall(
                index=choice.n_calls, id=call.id,
                function=FunctionCall(name=call.name, arguments=call.arguments))]), None, None))
            choice.n_calls += 1
        if out.finished:
            reason = out.finish_reason
            if choice.n_calls and reason == "stop":
                reason = "tool_calls"
            deltas.append((DeltaMessage(), reason, None))
        choice.add(out)
        return [ChatCompletionChunk(id=rid, model=self.model, choices=[ChatChunkChoice(
            index=choice.index, delta=d, finish_reason=r, logprobs=lp)]) for d, r, lp in deltas]

    def response(self, rid: str, choices: list[Choice], total: Usage) -> ChatCompletionResponse:
        out = []
        for c in choices:
            content: str | None = c.text
            calls: list[ParsedCall] = []
            if self.tools:
                content, calls = parse_tool_calls(c.text, self.tools)
            reason = c.last.finish_reason
            if calls and reason == "stop":
                reason = "tool_calls"
            message = AssistantMessage(content=content if calls else (content or ""),
                                       tool_calls=[ToolCall(id=k.id, function=FunctionCall(
                                           name=k.name, arguments=k.arguments)) for k in calls])
            out.append(ChatChoice(index=c.index, message=message, finish_reason=reason,
                                  logprobs=self.logprobs(c.logprobs) if self.want_logprobs
                                  else None))
        return ChatCompletionResponse(id=rid, model=self.model, choices=out, usage=total)
