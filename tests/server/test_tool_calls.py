"""The Qwen tool-call parser: hermes JSON (Qwen3-Next) and XML (Qwen3.5/3.6) blocks, streaming
in any split, invalid blocks kept as text."""

from __future__ import annotations

import json

import pytest

from deltaserve.server.tool_calls import ToolStreamParser, parse_tool_calls

TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                     "metric": {"type": "boolean"}}}}}]
HERMES = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": '
          '{"city": "Paris", "days": 3}}\n</tool_call>')
XML = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nNew York\n</parameter>\n"
       "<parameter=days>\n2\n</parameter>\n<parameter=metric>\ntrue\n</parameter>\n"
       "</function>\n</tool_call>")


def test_a_hermes_block_becomes_a_call_and_the_text_before_it_content():
    content, calls = parse_tool_calls(HERMES, TOOLS)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})]
    assert calls[0].id.startswith("call_")


def test_an_xml_block_reads_its_parameters_by_the_tool_schema():
    content, calls = parse_tool_calls(XML + "\n" + XML, TOOLS)
    assert content is None and len(calls) == 2
    assert json.loads(calls[0].arguments) == {"city": "New York", "days": 2, "metric": True}


@pytest.mark.parametrize("bad", ['<tool_call>\n{"name": "get_weather", "arguments": {"ci'
                                 '</tool_call>', "<tool_call>\n[1, 2]\n</tool_call>",
                                 "<tool_call>\n<function=>\n</function>\n</tool_call>",
                                 "<tool_call>\n{\"name\": \"x\""])
def test_invalid_or_unterminated_blocks_are_text(bad):
    assert parse_tool_calls("hi " + bad, TOOLS) == ("hi " + bad, [])


@pytest.mark.parametrize("step", [1, 2, 5, 11, 1000])
def test_streaming_in_any_split_gives_the_same_content_and_calls(step):
    text = HERMES + " ok <tool_ <tool_call>{bad}</tool_call>" + XML
    parser, content, calls = ToolStreamParser(TOOLS), "", []
    for i in range(0, len(text), step):
        piece, new = parser.feed(text[i:i + step])
        content += piece
        calls += new
        assert "<tool_call>\n{" not in content  # a valid block never leaks as text
    content += parser.finish()
    assert content == "Let me check.\n ok <tool_ <tool_call>{bad}</tool_call>"
    assert [c.name for c in calls] == ["get_weather", "get_weather"]



@pytest.mark.parametrize("text, expected", [
    ("Sure thing! \n" + HERMES[len("Let me check.\n"):], "Sure thing!"),
    (" \n" + XML + "\n\n  Done.\n" + XML + "\n", "Done."),
    (XML + "\n" + XML, None),
    ("a <tool_call>{bad}</tool_call>  \n" + XML, "a <tool_call>{bad}</tool_call>"),
    ("Hi \n there\n", "Hi \n there\n")])  # text only: all of it
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_a_stream_gives_the_content_of_the_whole_reply(text, expected, step):
    """Streamed and non-streamed chat send the same text, trimmed around the calls."""
    parser, content = ToolStreamParser(TOOLS), ""
    for i in range(0, len(text), step):
        content += parser.feed(text[i:i + step])[0]
    content += parser.finish()
    assert parse_tool_calls(text, TOOLS)[0] == (content or None) == expected
