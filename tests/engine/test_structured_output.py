"""Structured output: every sampled output matches its JSON schema or regex (xgrammar bitmask in
the sampler), with and without n-gram speculation."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest

from deltaserve import LLM, SamplingParams
from deltaserve.engine.grammar import GrammarSpec

sys.path.insert(0, str(Path(__file__).parents[1] / "server"))
from live_server import make_tiny_model  # noqa: E402  (the tiny model with a real tokenizer)

SCHEMA = {
    "type": "object",
    "properties": {
        # not maxLength: xgrammar 0.2.8 compiles a length-bounded string to [^"\\\r\n]{0,n},
        # which lets control characters through (invalid JSON); a pattern is exact
        "name": {"type": "string", "pattern": "^[A-Za-z ]{1,8}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pet": {"enum": ["cat", "dog", "none"]},
    },
    "required": ["name", "age", "pet"],
    "additionalProperties": False,
}
SEEDS = range(50)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("grammar") / "tiny"))


def make_llm(path: str, spec: str | None) -> LLM:
    cfg = (dict(speculative_algorithm=spec, speculative_num_steps=3, speculative_policy="fixed")
           if spec else {})
    return LLM(path, device="cpu", dtype="float32", num_pages=600, max_running_reqs=16,
               max_model_len=256, **cfg)


@pytest.mark.parametrize("spec", [None, "ngram"])
def test_every_sampled_output_validates_against_the_json_schema(tiny, spec):
    llm = make_llm(tiny, spec)
    grammar = GrammarSpec("json_schema", json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=96, structured=grammar)
              for s in SEEDS]
    outs = llm.generate([[1, 2, 3, 4]] * len(params), params)
    for seed, out in zip(SEEDS, outs):
        assert out.finish_reason == "stop", (seed, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA)
    assert len({o.text for o in outs}) > 5  # sampled, not one forced answer
    if spec:  # drafts were accepted under the mask (the matcher rolled back past them)
        assert llm.engine.acceptance_length > 1.0
    llm.engine.check_integrity()


def test_a_regex_constrains_greedy_output_and_json_object_gives_an_object(tiny):
    llm = make_llm(tiny, "ngram")
    regex = GrammarSpec("regex", r"<tool_call>\n\{\"name\": \"(get_weather|get_time)\"\}\n"
                                 r"</tool_call>")
    obj = GrammarSpec("json_object")
    outs = llm.generate([[5, 6, 7]] * 2, [
        SamplingParams(temperature=0.0, max_tokens=40, structured=regex),
        SamplingParams(temperature=0.7, seed=3, max_tokens=200, structured=obj)])
    assert re.fullmatch(r'<tool_call>\n\{"name": "get_(weather|time)"\}\n</tool_call>',
                        outs[0].text), outs[0].text
    if outs[1].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].text), dict)
    else:  # a long free object may run out of tokens; what there is must be a JSON prefix
        assert outs[1].text.lstrip().startswith("{")


def test_a_bad_schema_is_a_value_error_and_the_engine_keeps_serving(tiny):
    llm = make_llm(tiny, None)
    with pytest.raises(ValueError, match="cannot be compiled"):
        llm.generate([[1, 2]], SamplingParams(structured=GrammarSpec("json_schema", "{not")))
    out = llm.generate([[1, 2]], SamplingParams(temperature=0.0, max_tokens=3,
                                                ignore_eos=True))[0]
    assert len(out.token_ids) == 3
