"""A body that is not a JSON object gets a 400 (the OpenAI error object) saying what is wrong
and where: a syntax error's line, column and character, not FastAPI's "JSON decode error" or
"There was an error parsing the body"."""

from __future__ import annotations

import sys

import pytest

from deltaserve.server.body_errors import json_syntax_message


@pytest.mark.parametrize("body, message", [
    (b'{"prompt": "Hi",', "Malformed JSON in the request body: Expecting property name enclosed "
                         "in double quotes at line 1 column 17 (character 16), where the body "
                         "ends: is it cut short?"),
    (b'{\n  "prompt": "Hi"\n  "max_tokens": 3\n}', "Malformed JSON in the request body: "
     "Expecting ',' delimiter at line 3 column 3 (character 21)"),
    (b'{"prompt": "Hi"} x', "Malformed JSON in the request body: more data after the JSON "
                           "object at line 1 column 18 (character 17)"),
    (b"{'prompt': 'Hi'}", "Malformed JSON in the request body: Expecting property name "
                         "enclosed in double quotes at line 1 column 2 (character 1)"),
    (b"  \n ", "the request body is empty (whitespace only): send a JSON object"),
    (b"", "the request body is empty: send a JSON object"),
    (b"[" * 100_000, "the request body nests arrays or objects too deeply to parse"),
    (b'{"a":' * 5_000, "the request body nests arrays or objects too deeply to parse"),
    (b'{"prompt": "Hi", "max_tokens": ' + b"9" * 5_000 + b"}",
     f"a number in the request body has more than {sys.get_int_max_str_digits()} digits"),
    (b"null", "the request body must be a JSON object, not null"),
    (b'["Hi"]', "the request body must be a JSON object, not an array"),
])
def test_a_body_that_is_not_a_json_object_is_a_400_saying_what_and_where(client, body,
                                                                          message):
    for route in ("/v1/completions", "/v1/chat/completions"):
        r = client.post(route, content=body, headers={"content-type": "application/json"})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["message"].startswith(message), error["message"]
        assert error == {"message": error["message"], "type": "invalid_request_error",
                         "param": None, "code": None}
    assert client.get("/health").status_code == 200


def test_the_position_counts_lines_and_columns_from_1_and_characters_from_0():
    text = '{"a": 1,\n"b": x}'
    message = json_syntax_message("Expecting value", text, text.index("x"))
    assert message.endswith("Expecting value at line 2 column 6 (character 14)")
    assert json_syntax_message("Expecting value", None, None) == (
        "Malformed JSON in the request body: Expecting value")
