"""Request models: OpenAI defaults, field mapping onto SamplingParams, unsupported fields."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from deltaserve.server.protocol import ChatCompletionRequest, CompletionRequest, InvalidRequest
from deltaserve.server.responses import Usage
from deltaserve.server.serving import OpenAIServing


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **fields)


def test_unset_fields_take_the_openai_defaults():
    params = CompletionRequest(prompt="x").to_sampling_params(16)
    assert (params.temperature, params.top_p, params.top_k, params.max_tokens) == (1.0, 1.0, -1, 16)
    assert params.stop == [] and params.seed is None and not params.ignore_eos


def test_vllm_extensions_and_a_single_stop_string_map_onto_sampling_params():
    body = CompletionRequest(prompt="x", stop="END", top_k=5, min_p=0.1,
                             repetition_penalty=1.2, stop_token_ids=[7], ignore_eos=True, seed=3)
    params = body.to_sampling_params(4)
    assert params.stop == ["END"] and params.top_k == 5 and params.min_p == 0.1
    assert params.repetition_penalty == 1.2 and params.stop_token_ids == [7]
    assert params.ignore_eos and params.seed == 3


def test_max_completion_tokens_wins_over_max_tokens_and_is_named_in_errors():
    body = chat(max_tokens=5, max_completion_tokens=0)
    assert body.max_tokens_param() == (0, "max_completion_tokens")
    with pytest.raises(InvalidRequest) as e:
        body.to_sampling_params(0)
    assert e.value.param == "max_completion_tokens"
    assert "max_completion_tokens" in e.value.message


@pytest.mark.parametrize("fields,param", [
    ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"min_p": 2.0}, "min_p"), ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"stop": ["ok", ""]}, "stop"),
])
def test_a_bad_sampling_field_is_named_as_the_param(fields, param):
    with pytest.raises(InvalidRequest) as e:
        CompletionRequest(prompt="x", **fields).to_sampling_params(16)
    assert e.value.param == param and e.value.status == 400


@pytest.mark.parametrize("body,param", [
    (CompletionRequest(prompt="x", n=0), "n"),
    (CompletionRequest(prompt="x", n=129), "n"),
    (CompletionRequest(prompt="x", logprobs=21), "logprobs"),
    (CompletionRequest(prompt="x", n=3, best_of=2), "best_of"),
    (CompletionRequest(prompt="x", best_of=2, stream=True), "best_of"),
    (CompletionRequest(prompt="x", echo=True), "echo"),
    (CompletionRequest(prompt=["a", "b"]), "prompt"),
    (CompletionRequest(prompt=[]), "prompt"),
    (chat(top_logprobs=2), "top_logprobs"),
    (chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    (chat(tools=[{"type": "function"}]), "tools.0"),
    (chat(response_format={"type": "yaml"}), "response_format"),
    (ChatCompletionRequest(messages=[]), "messages"),
    (CompletionRequest(prompt="x", logit_bias={"5": 100}), "logit_bias"),
    (chat(logit_bias={"5": -100}), "logit_bias"),
    (chat(tool_choice="required"), "tool_choice"),
    (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice"),
    (chat(functions=[{"name": "f"}]), "functions"),
    (chat(function_call="auto"), "function_call"),
    (ChatCompletionRequest(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "function_call": {"name": "f", "arguments": "{}"}}]),
     "messages.1.function_call"),
    (ChatCompletionRequest(messages=[
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{x"}}]},
        {"role": "tool", "tool_call_id": "1", "content": "42"}]), "messages.1.tool_calls.0"),
])
def test_unsupported_fields_are_refused_not_ignored(body, param):
    with pytest.raises(InvalidRequest) as e:
        body.check_supported()
    assert e.value.param == param


@pytest.mark.parametrize("choice, says", [
    ("required", "forcing a call"),
    ({"type": "function", "function": {"name": "f"}}, "forcing a call"),
    ("bogus", 'got "bogus"'),  # not a forced call: named as what it is
    ({"type": "tool"}, 'got {"type": "tool"}'),
])
def test_a_refused_tool_choice_says_why(choice, says):
    with pytest.raises(InvalidRequest, match=says):
        chat(tool_choice=choice).check_supported()


@pytest.mark.parametrize("fields, says", [
    ({"logprobs": True, "top_logprobs": 25}, r"top_logprobs must be in \[0, 20\], got 25"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs: true"),
    ({"logprobs": False, "top_logprobs": 25}, r"must be in \[0, 20\]"),
])
def test_a_refused_top_logprobs_says_which_rule_it_broke(fields, says):
    with pytest.raises(InvalidRequest, match=says):
        chat(**fields).check_supported()


def test_tool_choice_auto_without_tools_is_refused():
    with pytest.raises(InvalidRequest, match="tool_choice needs tools") as e:
        chat(tool_choice="auto").check_supported()
    assert e.value.param == "tool_choice"
    chat(tool_choice="auto", tools=[{"type": "function", "function": {"name": "f"}}]
         ).check_supported()


def test_tool_choice_none_and_a_tool_result_message_are_accepted():
    """tool_choice "none" asks for what deltaserve does anyway; a tool message is plain text."""
    chat(tool_choice="none").check_supported()
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"},
                                           {"role": "tool", "content": "42"}])
    body.check_supported()
    assert body.template_messages()[1] == {"role": "tool", "content": "42"}


def test_chat_messages_become_template_messages():
    body = ChatCompletionRequest(messages=[
        {"role": "developer", "content": "Be terse."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
    ])
    assert body.template_messages() == [{"role": "system", "content": "Be terse."},
                                        {"role": "user", "content": "ab"}]
    image = ChatCompletionRequest(messages=[
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(InvalidRequest) as e:
        image.template_messages()
    assert e.value.param == "messages.0.content"


@pytest.mark.parametrize("message,says", [
    ({"role": "user"}, "user message needs content"),
    ({"role": "system", "content": None}, "system message needs content"),
    ({"role": "user", "content": [{"type": "text"}]}, "needs a 'text' string"),
    ({"role": "user", "content": []}, "user message needs content"),
])
def test_a_message_without_text_is_refused_with_what_is_missing(message, says):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}, message])
    with pytest.raises(InvalidRequest) as e:
        body.template_messages()
    assert e.value.param == "messages.1.content" and says in e.value.message


def test_an_assistant_message_may_leave_content_out():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"},
                                           {"role": "assistant", "content": None},
                                           {"role": "assistant", "content": []}])
    assert body.template_messages()[1:] == [{"role": "assistant", "content": ""}] * 2


def test_stream_options_without_stream_is_refused_as_in_openai():
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}],
                                 stream_options={"include_usage": True})
    with pytest.raises(InvalidRequest) as e:
        body.check_supported()
    assert e.value.param == "stream_options" and "stream is true" in e.value.message
    ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], stream=True,
                          stream_options={"include_usage": True}).check_supported()


def test_usage_reports_cached_tokens_in_the_openai_field():
    usage = Usage.of(prompt=200, completion=5, cached=128).model_dump()
    assert usage == {"prompt_tokens": 200, "completion_tokens": 5, "total_tokens": 205,
                     "prompt_tokens_details": {"cached_tokens": 128}}


@pytest.mark.parametrize("field", ["stream", "ignore_eos"])
@pytest.mark.parametrize("value", ["yes", "true", 1, 0])
def test_switches_take_json_booleans_only(field, value):
    with pytest.raises(ValidationError, match=field):
        CompletionRequest.model_validate({"prompt": "x", field: value})
    assert getattr(CompletionRequest.model_validate({"prompt": "x", field: True}), field) is True


def test_an_unset_max_tokens_is_capped_by_the_kv_pool_as_well_as_the_context():
    # a pool smaller than the context: a default of "the rest of the context" would reserve
    # more pages than exist and be refused although the user asked for nothing
    serving = OpenAIServing(SimpleNamespace(max_model_len=512, max_request_len=300), None)
    chat_body = chat()
    assert serving.sampling_params(chat_body, [1] * 20, "messages", None).max_tokens == 280
    completion = CompletionRequest(prompt="x")
    assert serving.sampling_params(completion, [1] * 20, "prompt", 16).max_tokens == 16
    roomy = OpenAIServing(SimpleNamespace(max_model_len=512, max_request_len=512), None)
    assert roomy.sampling_params(chat_body, [1] * 20, "messages", None).max_tokens == 492
    explicit = chat(max_tokens=400)  # explicit: kept; the engine names the pool if too big
    assert serving.sampling_params(explicit, [1] * 20, "messages", None).max_tokens == 400


@pytest.mark.parametrize("says,body,prompt_param,param", [
    ("prompt of 20 tokens does not fit the KV pool", CompletionRequest(prompt="x"), "prompt",
     "prompt"),
    ("prompt of 20 tokens does not fit the KV pool", chat(), "messages", "messages"),
    ("max_tokens 400 does not fit the KV pool", chat(max_tokens=400), "messages", "max_tokens"),
])
def test_the_engines_refusal_names_the_field_its_first_word_names(says, body, prompt_param,
                                                                  param):
    """The server's param is the first word of the engine's ValueError when that is a field of
    the request, else the request's prompt field (chat has no `prompt`)."""
    class Refusing:
        max_model_len, max_request_len = 512, 512

        async def add(self, prompt_ids, params):
            raise ValueError(says + ": ...")

    serving = OpenAIServing(Refusing(), None)
    with pytest.raises(InvalidRequest) as e:
        asyncio.run(serving._start("r", body, [1] * 20, prompt_param, 16))
    assert e.value.param == param and e.value.message.startswith(says)



@pytest.mark.parametrize("field,value", [("min_tokens", 5), ("use_beam_search", True),
                                         ("include_stop_str_in_output", True),
                                         ("allowed_token_ids", [1, 2]),
                                         ("guided_grammar", "root ::= \"a\""),
                                         ("structured_outputs", {"regex": "a+"})])
def test_vllm_extensions_that_would_change_the_output_are_refused_not_ignored(field, value):
    with pytest.raises(InvalidRequest) as e:
        CompletionRequest(prompt="Hi", **{field: value}).check_supported()
    assert e.value.param == field and "not supported" in e.value.message


@pytest.mark.parametrize("extra,param", [({"echo": True}, "echo"),
                                         ({"chat_template": "{{ messages }}"}, "chat_template"),
                                         ({"continue_final_message": True},
                                          "continue_final_message"),
                                         ({"add_generation_prompt": False},
                                          "add_generation_prompt"),
                                         ({"chat_template_kwargs": {"tokenize": True}},
                                          "chat_template_kwargs"),
                                         ({"chat_template_kwargs": {"add_generation_prompt":
                                                                    False}},
                                          "chat_template_kwargs"),
                                         ({"chat_template_kwargs": {"messages": []}},
                                          "chat_template_kwargs")])
def test_chat_extensions_that_would_change_the_rendered_prompt_are_refused(extra, param):
    body = ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], **extra)
    with pytest.raises(InvalidRequest) as e:
        body.check_supported()
    assert e.value.param == param
    ChatCompletionRequest(messages=[{"role": "user", "content": "Hi"}], echo=False,
                          add_generation_prompt=True,
                          chat_template_kwargs={"enable_thinking": False}).check_supported()


def test_best_of_on_chat_is_refused_unless_it_changes_nothing():
    # a fresh user's finding: a streamed chat request with best_of 3 > n 2 got 200, best_of
    # silently ignored (chat completions have no best_of; /v1/completions does)
    msgs = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidRequest) as e:
        ChatCompletionRequest(messages=msgs, n=2, best_of=3, stream=True).check_supported()
    assert e.value.param == "best_of" and "/v1/completions" in e.value.message
    ChatCompletionRequest(messages=msgs, n=2, best_of=2).check_supported()
    ChatCompletionRequest(messages=msgs, best_of=1).check_supported()


def test_vllm_extensions_left_at_their_defaults_and_unknown_fields_are_accepted():
    CompletionRequest(prompt="Hi", min_tokens=0, use_beam_search=False, guided_json=None,
                      allowed_token_ids=[], unknown_field=1).check_supported()


@pytest.mark.parametrize("body", [
    CompletionRequest(prompt="x", response_format="json"),
    CompletionRequest(prompt="x", response_format=["a"]),
    CompletionRequest(prompt="x", response_format=5),
    CompletionRequest(prompt="x", response_format={"type": "yaml"}),
    CompletionRequest(prompt="x", response_format={"type": {}}),
    CompletionRequest(prompt="x", response_format={"type": "json_schema", "json_schema": "s"}),
    chat(response_format={"type": "json_schema", "json_schema": "s"}),
    chat(response_format={"type": "json_schema", "json_schema": [1]}),
    chat(response_format={"type": "json_schema", "json_schema": {"schema": 3}}),
])
def test_a_malformed_response_format_is_a_request_error_on_both_endpoints(body):
    """Was a 500 (AttributeError) for a non-object response_format or json_schema, and an
    unknown type was ignored on /v1/completions."""
    from deltaserve.server.structured import grammar_spec

    with pytest.raises(InvalidRequest) as e:
        grammar_spec(body)
    assert e.value.param == "response_format"


def test_a_json_schema_response_format_becomes_its_grammar():
    from deltaserve.server.structured import grammar_spec

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    for body in (CompletionRequest(prompt="x", response_format={
                     "type": "json_schema", "json_schema": {"name": "n", "schema": schema}}),
                 chat(response_format={"type": "json_schema",
                                       "json_schema": {"name": "n", "schema": schema}})):
        spec, param = grammar_spec(body)
        assert param == "response_format" and spec.kind == "json_schema"
        assert spec.value == '{"type": "object", "properties": {"a": {"type": "integer"}}}'
    assert grammar_spec(CompletionRequest(prompt="x", response_format={"type": "text"})) == (
        None, None)
