"""A tool-call round trip over HTTP (openai client), streamed and not, on a tiny model whose
chat template renders tools in the Qwen3 (hermes) way; the output is forced into a tool-call
block by a guided_regex grammar. This server runs n-gram speculation, so the JSON-schema check
runs here with speculation on as well."""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest
from live_server import LiveServer

from deltaserve.server.api import build_app
from deltaserve.server.async_engine import AsyncEngine

# a small template of the Qwen3 kind (tools listed in a system turn, calls and responses
# wrapped in tags), written for this test
TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nTools:{% for t in tools %}\n{{ t | tojson }}"
    "{% endfor %}\nCall one as <tool_call>\n{\"name\": ..., \"arguments\": ...}\n</tool_call>"
    "<|im_end|>\n{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{{ m.content or '' }}{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n"
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                   "required": ["city"]}}}]
FORCE = {"guided_regex": r'<tool_call>\n\{"name": "get_weather", "arguments": '
                         r'\{"city": "(Paris|Rome)"\}\}\n</tool_call>'}
USER = [{"role": "user", "content": "Weather in Paris?"}]


@pytest.fixture(scope="module")
def tool_server(tiny_model, tmp_path_factory):
    from deltaserve.config import EngineConfig
    from deltaserve.engine.llm_engine import LLMEngine

    folder = tmp_path_factory.mktemp("tools") / "m"
    shutil.copytree(tiny_model, folder)
    cfg_path = folder / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    engine = AsyncEngine(LLMEngine(EngineConfig(
        model=str(folder), device="cpu", dtype="float32", max_model_len=512, page_size=16,
        num_pages=400, max_running_reqs=8, speculative_algorithm="ngram",
        speculative_num_steps=3)))
    server = LiveServer(build_app(engine))
    server.start()
    try:
        yield openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused",
                            max_retries=0, timeout=60), engine.model_name
    finally:
        server.stop()
        engine.shutdown()


def test_a_tool_call_round_trip(tool_server):
    oai, model = tool_server
    plain = oai.chat.completions.create(model=model, messages=USER, max_tokens=1)
    first = oai.chat.completions.create(model=model, messages=USER, tools=TOOLS,
                                        max_tokens=60, temperature=0, extra_body=FORCE)
    assert first.usage.prompt_tokens > plain.usage.prompt_tokens  # the tools reached the prompt
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    history = USER + [choice.message.model_dump(exclude_none=True),
                      {"role": "tool", "tool_call_id": call.id, "content": "21 C, sunny"}]
    second = oai.chat.completions.create(model=model, messages=history, tools=TOOLS,
                                         max_tokens=3, temperature=0,
                                         extra_body={"ignore_eos": True})
    assert second.choices[0].finish_reason == "length"
    assert second.usage.prompt_tokens > first.usage.prompt_tokens + 10  # call + result rendered


def test_a_streamed_tool_call_arrives_as_a_tool_calls_delta(tool_server):
    oai, model = tool_server
    kwargs = dict(model=model, messages=USER, tools=TOOLS, max_tokens=60, temperature=0,
                  extra_body=FORCE)
    whole = oai.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c for c in oai.chat.completions.create(stream=True, **kwargs) if c.choices]
    calls = [tc for c in chunks for tc in (c.choices[0].delta.tool_calls or [])]
    assert [(tc.index, tc.function.name, tc.function.arguments) for tc in calls] == [
        (0, "get_weather", whole.function.arguments)]
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)  # no tag leaked
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_leaves_the_block_as_text_and_required_is_refused(tool_server):
    oai, model = tool_server
    out = oai.chat.completions.create(model=model, messages=USER, tools=TOOLS,
                                      tool_choice="none", max_tokens=60, temperature=0,
                                      extra_body=FORCE)
    assert out.choices[0].message.content.startswith("<tool_call>")
    assert not out.choices[0].message.tool_calls
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=model, messages=USER, tools=TOOLS,
                                    tool_choice="required")
    assert e.value.body["param"] == "tool_choice"


def test_fifty_json_schema_outputs_validate_with_ngram_speculation(tool_server):
    oai, model = tool_server
    schema = {"type": "object", "properties": {
        "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 999},
        "tag": {"enum": ["a", "b", "c"]}}, "required": ["ok", "n", "tag"],
        "additionalProperties": False}
    out = oai.chat.completions.create(
        model=model, messages=USER, n=50, seed=100, max_tokens=60, temperature=1.0,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    for c in out.choices:
        assert c.finish_reason == "stop", c.message.content
        jsonschema.validate(json.loads(c.message.content), schema)
