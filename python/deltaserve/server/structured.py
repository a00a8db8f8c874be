"""The request fields that constrain the output, turned into one engine GrammarSpec.

Chat: `response_format` {"type": "json_object"} or {"type": "json_schema", "json_schema":
{"name", "schema", "strict"}} (OpenAI); both endpoints: vLLM's `guided_json` (a schema, as an
object or a JSON string) and `guided_regex`. At most one may be set.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from deltaserve.engine.grammar import GrammarSpec

if TYPE_CHECKING:
    from deltaserve.server.protocol import _GenerationRequest


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def response_format_kind(fmt: Any) -> str:
    """The type of a `response_format` field (None: "text"). Raises InvalidRequest unless it
    is an object whose type is one of RESPONSE_FORMATS (/v1/completions takes it as an
    unchecked extra, so anything can arrive here)."""
    from deltaserve.server.protocol import InvalidRequest

    fmt = {} if fmt is None else fmt
    if not isinstance(fmt, dict):
        raise InvalidRequest("response_format must be an object with a type", "response_format")
    kind = fmt.get("type", "text")
    if kind not in RESPONSE_FORMATS:
        raise InvalidRequest(f"response_format type must be {', '.join(RESPONSE_FORMATS)}",
                             "response_format")
    return kind


def grammar_spec(body: _GenerationRequest) -> tuple[GrammarSpec | None, str | None]:
    """(spec, the field it came from), (None, None) when the output is free. Raises
    InvalidRequest for a malformed field or more than one."""
    from deltaserve.server.protocol import InvalidRequest

    found: list[tuple[GrammarSpec, str]] = []
    fmt = getattr(body, "response_format", None)
    kind = response_format_kind(fmt)
    if kind == "json_object":
        found.append((GrammarSpec("json_object"), "response_format"))
    elif kind == "json_schema":
        inner = fmt.get("json_schema")
        schema = inner.get("schema") if isinstance(inner, dict) else None
        if not isinstance(schema, dict):
            raise InvalidRequest("response_format json_schema needs json_schema.schema, a JSON "
                                 "schema object", "response_format")
        found.append((GrammarSpec("json_schema", json.dumps(schema)), "response_format"))
    extra = body.model_extra or {}
    guided = extra.get("guided_json")
    if guided is not None:
        if isinstance(guided, str):
            try:
                guided = json.loads(guided)
            except json.JSONDecodeError as e:
                raise InvalidRequest(f"guided_json is not JSON: {e}", "guided_json") from e
        if not isinstance(guided, dict):
            raise InvalidRequest("guided_json must be a JSON schema object", "guided_json")
        found.append((GrammarSpec("json_schema", json.dumps(guided)), "guided_json"))
    regex = extra.get("guided_regex")
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise InvalidRequest("guided_regex must be a non-empty string", "guided_regex")
        found.append((GrammarSpec("regex", regex), "guided_regex"))
    if len(found) > 1:
        raise InvalidRequest(f"set only one of {', '.join(p for _, p in found)}", found[1][1])
    return found[0] if found else (None, None)
