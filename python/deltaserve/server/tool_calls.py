"""Tool calls of Qwen3.5 / Qwen3.6 and Qwen3-Next: parsing the model's `<tool_call>` blocks.

Both families wrap each call in `<tool_call>` ... `</tool_call>`; what is inside differs:
- Qwen3-Next (the Qwen3 chat template, "hermes" style): one JSON object
  `{"name": NAME, "arguments": {...}}`;
- Qwen3.5 / Qwen3.6 (the Qwen3-Coder XML style): `<function=NAME>` then one
  `<parameter=KEY>` VALUE `</parameter>` per argument, then `</function>`. A VALUE is kept as
  text when the tool's JSON schema types that parameter "string" (or does not say), else read
  as JSON (numbers, booleans, objects), falling back to the text.
The block's kind is told by its first character, so one parser serves both. A block that does
not parse (bad JSON, no name) stays in the content as text, never an error: the model's output
is reported, not refused.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

START, END = "<tool_call>", "</tool_call>"
_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|$)", re.DOTALL)
_PARAM = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|$)", re.DOTALL)


@dataclass(slots=True)
class ParsedCall:
    """One tool call: the function's name and its arguments as a JSON object string."""

    name: str
    arguments: str
    id: str = ""

    def __post_init__(self) -> None:
        if not self.id:
            self.id = f"call_{uuid.uuid4().hex[:24]}"


def _param_types(tools: list[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """function name -> {parameter name: its JSON schema}."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools or []:
        fn = tool.get("function") or {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        out[str(fn.get("name"))] = props if isinstance(props, dict) else {}
    return out


def parse_block(body: str, tools: list[dict[str, Any]] | None) -> ParsedCall | None:
    """The call inside one `<tool_call>` block (without the tags), or None if it is not one."""
    text = body.strip()
    if text.startswith("{"):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        if isinstance(args, str):  # some models emit the arguments already encoded
            try:
                args = json.loads(args)
            except json.JSONDecodeError:
                return None
        if not isinstance(args, dict):
            return None
        return ParsedCall(obj["name"], json.dumps(args, ensure_ascii=False))
    m = _FUNCTION.match(text)
    if m is None or not m.group(1).strip():
        return None
    name = m.group(1).strip()
    schema = _param_types(tools).get(name, {})
    args: dict[str, Any] = {}
    for pm in _PARAM.finditer(m.group(2)):
        key = pm.group(1).strip()
        value = pm.group(2).strip("\n")
        kind = (schema.get(key) or {}).get("type", "string")
        if kind != "string":
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass
        args[key] = value
    return ParsedCall(name, json.dumps(args, ensure_ascii=False))


def parse_tool_calls(text: str, tools: list[dict[str, Any]] | None
                     ) -> tuple[str | None, list[ParsedCall]]:
    """Split a finished output into (content, calls), exactly as a stream of it gives them
    (ToolStreamParser): content is the text outside the blocks that parsed, blocks that did
    not parse included, None when empty."""
    parser = ToolStreamParser(tools)
    content, calls = parser.feed(text)
    content += parser.finish()
    return content or None, calls


class ToolStreamParser:
    """Incremental `parse_tool_calls` for a stream: `feed(delta)` returns the content text that
    is safe to send now and the calls completed by it; `finish()` flushes the rest.

    Text that may start a `<tool_call>` tag is held back until it is told apart; a block is
    held until its `</tool_call>`, then sent as one call (a tool_calls delta carrying the
    whole arguments string) or, if it does not parse, as content. The content around calls
    is trimmed as it streams ("Sure! \n<tool_call>..." gives "Sure!"): whitespace is held
    until text follows it, and dropped at the end when a call parsed; leading whitespace is
    dropped when a call came before any text. A reply without calls keeps all of its text.
    """

    def __init__(self, tools: list[dict[str, Any]] | None) -> None:
        self.tools = tools
        self._buf = ""
        self._space = ""  # trailing whitespace held back
        self._called = self._spoke = False  # a call parsed / some content sent

    def feed(self, delta: str) -> tuple[str, list[ParsedCall]]:
        self._buf += delta
        text, calls = [], []
        while True:
            start = self._buf.find(START)
            if start < 0:
                keep = _partial_suffix(self._buf, START)
                text.append(self._content(self._buf[:len(self._buf) - keep]))
                self._buf = self._buf[len(self._buf) - keep:]
                break
            text.append(self._content(self._buf[:start]))
            end = self._buf.find(END, start)
            if end < 0:
                self._buf = self._buf[start:]
                break
            block = self._buf[start:end + len(END)]
            self._buf = self._buf[end + len(END):]
            call = parse_block(block[len(START):-len(END)], self.tools)
            if call is None:
                text.append(self._content(block))
            else:
                calls.append(call)
                self._called = True
        return "".join(text), calls

    def finish(self) -> str:
        """The held-back text (an unterminated block is content; trailing whitespace only when
        no call parsed)."""
        rest, self._buf = self._content(self._buf), ""
        space, self._space = ("" if self._called else self._space), ""
        return rest + space

    def _content(self, piece: str) -> str:
        """What of `piece` (content text) to send now; its trailing whitespace is held."""
        piece = self._space + piece
        body = piece.rstrip()
        self._space = piece[len(body):]
        if body and not self._spoke:
            self._spoke = True
            if self._called:
                body = body.lstrip()
        return body


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
