"""The request side of tool calling: checking `tools`, `tool_choice` and the history's calls.

`tools` are handed to the checkpoint's chat template (apply_chat_template(tools=...)), which
renders them in the model's own format; with tool_choice "auto" (the default when tools are
given) the output's `<tool_call>` blocks are parsed into tool_calls (server/tool_calls.py);
with "none" the tools are still rendered (as vLLM does by default) and nothing is parsed.
"required" and a named function would need the output forced into a block: refused for now.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deltaserve.server.protocol import ChatCompletionRequest


def _invalid(message: str, param: str):
    from deltaserve.server.protocol import InvalidRequest  # protocol imports this module

    return InvalidRequest(message, param)


def check_tools(body: ChatCompletionRequest) -> None:
    """Raise InvalidRequest for malformed tools, an unsupported tool_choice, or malformed
    tool calls in the history."""
    for i, tool in enumerate(body.tools or []):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" \
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str) \
                or not fn["name"]:
            raise _invalid('each tool must be {"type": "function", "function": {"name": ...}}',
                           f"tools.{i}")
        if not isinstance(fn.get("parameters", {}), dict):
            raise _invalid("a tool's parameters must be a JSON schema object",
                           f"tools.{i}.function.parameters")
    choice = body.tool_choice
    if choice not in (None, "none", "auto"):
        if choice == "required" or (isinstance(choice, dict)
                                    and choice.get("type") == "function"):
            raise _invalid("tool_choice must be \"auto\" or \"none\": forcing a call "
                           "(\"required\" or a named function) is not supported by deltaserve",
                           "tool_choice")
        raise _invalid(f"tool_choice must be \"auto\" or \"none\" (OpenAI also defines "
                       f"\"required\" and a named function, which deltaserve does not "
                       f"support); got {json.dumps(choice)[:100]}", "tool_choice")
    if choice not in (None, "none") and not body.tools:  # vLLM's rule (it was ignored)
        raise _invalid("tool_choice needs tools: without them no call can be made",
                       "tool_choice")
    for i, m in enumerate(body.messages):
        if m.tool_calls:
            if m.role != "assistant":
                raise _invalid("only assistant messages carry tool_calls",
                               f"messages.{i}.tool_calls")
            history_calls(m.tool_calls, i)


def history_calls(calls: list[Any], index: int) -> list[dict[str, Any]]:
    """An assistant turn's tool calls for the template, arguments decoded from their JSON
    string (the Qwen3.5 template iterates them as a mapping). Raises InvalidRequest."""
    out = []
    for j, call in enumerate(calls):
        param = f"messages.{index}.tool_calls.{j}"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise _invalid('a tool call must be {"id", "type": "function", "function": '
                           '{"name", "arguments"}}', param)
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args or "{}")
            except json.JSONDecodeError as e:
                raise _invalid(f"tool call arguments are not JSON: {e}", param) from e
        if not isinstance(args, dict):
            raise _invalid("tool call arguments must be a JSON object", param)
        out.append({"id": call.get("id"), "type": "function",
                    "function": {"name": fn["name"], "arguments": args}})
    return out


def parses_tool_calls(body: ChatCompletionRequest) -> bool:
    """Whether the output's tool-call blocks become tool_calls."""
    return bool(body.tools) and body.tool_choice != "none"
