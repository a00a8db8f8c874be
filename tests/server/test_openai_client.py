"""The official `openai` Python client against the live loopback server."""

from __future__ import annotations

import openai
import pytest
from live_server import MAX_MODEL_LEN

GREEDY_EXTRA = {"ignore_eos": True}


@pytest.fixture
def oai(served) -> openai.OpenAI:
    return openai.OpenAI(base_url=served.base_url + "/v1", api_key="unused", max_retries=0,
                         timeout=30)


def test_the_client_lists_the_served_model(oai, served):
    assert [m.id for m in oai.models.list()] == [served.model]


def test_chat_completion_through_the_client(oai, served):
    out = oai.chat.completions.create(
        model=served.model, messages=[{"role": "user", "content": "Hello"}],
        max_completion_tokens=5, temperature=0, extra_body=GREEDY_EXTRA)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5
    assert out.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_through_the_client(oai, served):
    out = oai.completions.create(model=served.model, prompt="Hello", max_tokens=4,
                                 temperature=0, extra_body=GREEDY_EXTRA)
    assert out.usage.completion_tokens == 4
    assert isinstance(out.choices[0].text, str)


def test_streamed_chat_matches_the_non_streamed_answer(oai, served):
    kwargs = dict(model=served.model, messages=[{"role": "user", "content": "Count"}],
                  max_tokens=6, temperature=0, extra_body=GREEDY_EXTRA)
    full = oai.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(oai.chat.completions.create(stream=True,
                                              stream_options={"include_usage": True},
                                              **kwargs))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


def test_streamed_completion_through_the_client(oai, served):
    chunks = list(oai.completions.create(model=served.model, prompt="Hi", max_tokens=5,
                                         temperature=0, stream=True, extra_body=GREEDY_EXTRA))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_bad_requests_raise_bad_request_error(oai, served):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=served.model, temperature=-1,
                                    messages=[{"role": "user", "content": "Hi"}])
    assert e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=served.model, prompt="Hi", top_p=0)
    assert e.value.body["param"] == "top_p"
    with pytest.raises(openai.BadRequestError) as e:
        oai.completions.create(model=served.model, prompt=[7] * (MAX_MODEL_LEN + 1))
    assert e.value.body["param"] == "prompt"
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=served.model, n=0,
                                    messages=[{"role": "user", "content": "Hi"}])
