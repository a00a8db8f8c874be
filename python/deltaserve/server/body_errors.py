"""What is wrong with a request body, in words: the messages of its 400s.

FastAPI parses the body with `json.loads` and reports a syntax error as a `json_invalid`
validation error holding the position (and the text as the error's body); anything else
`json.loads` raises (nesting past Python's recursion limit, an integer past its digit limit)
comes as a 400 HTTPException "There was an error parsing the body" whose cause is the error.
Pydantic's validation errors are turned into one message naming the field (the `param`).
"""

from __future__ import annotations

import re
import sys

from fastapi.exceptions import RequestValidationError

_TYPE_TAG = re.compile(r"^(str|int|float|bool|list|dict|none)$|[\[\-]")


def _json_kind(value: object) -> str:
    """How a JSON value (or a body that was not JSON) reads in an error message."""
    if value is None:
        return "null"
    if isinstance(value, (bytes, bytearray)):
        return "a body that is not JSON"
    for kind, name in ((bool, "a boolean"), (int, "a number"), (float, "a number"),
                       (str, "a string"), (list, "an array"), (dict, "an object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _param_and_tag(error: dict) -> tuple[str | None, str | None]:
    """(dotted param path, the first union type tag in its location, if any)."""
    path = []
    for part in (str(p) for p in error.get("loc", ()) if p != "body"):
        if _TYPE_TAG.search(part):
            return ".".join(path) or None, part
        path.append(part)
    return ".".join(path) or None, None


def validation_message(exc: RequestValidationError,
                       content_type: str = "application/json") -> tuple[str, str | None]:
    """(message, param) for the first pydantic error; the param path skips union type tags.
    A value no member of a union accepts is one message naming the members and what came; a
    body that is not a JSON object names its Content-Type when that is not JSON; a JSON
    syntax error says what and where (json_syntax_message)."""
    errors = exc.errors()
    if not errors:
        return "invalid request", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        loc = first.get("loc", ())
        position = loc[-1] if len(loc) == 2 and isinstance(loc[-1], int) else None
        reason = (first.get("ctx") or {}).get("error") or first.get("msg") or "invalid JSON"
        return json_syntax_message(str(reason), exc.body, position), None
    param, tag = _param_and_tag(first)
    if param is None and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if param is None and tuple(first.get("loc", ())) == ("body",):
        if content_type.split(";")[0].strip().lower() != "application/json":
            sent = f"not {content_type}" if content_type else "the request has none"
            return ("the request body must be a JSON object sent as Content-Type: "
                    f"application/json ({sent})"), None
        return ("the request body must be a JSON object, not "
                f"{_json_kind(first.get('input'))}"), None
    if tag is not None:
        tags = [t for p, t in map(_param_and_tag, errors) if p == param and t is not None]
        if len(tags) == len(errors) and len(tags) > 1:
            expected = ", ".join(dict.fromkeys(tags))
            got = _json_kind(first.get("input"))
            if isinstance(first.get("input"), list):
                got += " whose items fit none of them"
            return f"{param}: expected one of {expected}; got {got}", param
    more = f" (and {len(errors) - 1} more errors)" if len(errors) > 1 else ""
    return f"{param or 'body'}: {first.get('msg')}{more}", param


def json_syntax_message(reason: str, text: object, position: int | None) -> str:
    """A JSON syntax error (json.JSONDecodeError's `msg`, the decoded body, the character
    offset) as a message naming the line, column and character where it is; a body of
    whitespace only is called empty, and an error at its very end says the body ends there."""
    if not isinstance(text, str) or position is None:
        return f"Malformed JSON in the request body: {reason}"
    if not text.strip():
        return "the request body is empty (whitespace only): send a JSON object"
    line = text.count("\n", 0, position) + 1
    column = position - text.rfind("\n", 0, position)
    where = f"line {line} column {column} (character {position})"
    if position >= len(text.rstrip()):
        where += ", where the body ends: is it cut short?"
    elif reason == "Extra data":
        reason = "more data after the JSON object"
    return f"Malformed JSON in the request body: {reason} at {where}"


def body_parse_message(cause: BaseException) -> str:
    """The message of a body `json.loads` failed on other than with a syntax error: `cause`
    is the error behind FastAPI's "There was an error parsing the body"."""
    if isinstance(cause, UnicodeDecodeError):
        return (f"the request body is not valid UTF-8 (byte {cause.start}): send JSON "
                "encoded as UTF-8")
    if isinstance(cause, RecursionError):
        return ("the request body nests arrays or objects too deeply to parse (Python's JSON "
                f"parser stops before {sys.getrecursionlimit()} levels)")
    if isinstance(cause, ValueError) and "integer string conversion" in str(cause):
        return (f"a number in the request body has more than {sys.get_int_max_str_digits()} "
                "digits")
    return f"the request body could not be parsed as JSON: {type(cause).__name__}: {cause}"
