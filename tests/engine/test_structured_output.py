"""Structured output: every sampled output matches its JSON schema or regex (xgrammar bitmask in
the sampler), with and without n-gram speculation."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import jsonschema
import pytest
import torch

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


def nested(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("spec, match", [
    (GrammarSpec("json_schema", json.dumps({"not": {"type": "string"}})), "uses 'not'"),
    (GrammarSpec("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"if": {"type": "integer"}, "then": {"minimum": 5}}}})), "uses 'if'"),
    (GrammarSpec("json_schema", json.dumps({"type": "array", "items": {
        "allOf": [{"type": "integer"}, {"minimum": 5}]}})), "'allOf' with more than one"),
    (GrammarSpec("json_schema", json.dumps({"type": "array", "contains": {"const": 1}})),
     "uses 'contains'"),
    (GrammarSpec("regex", "[^\\x00-\\U0010FFFF]"), "matches no output"),
    (GrammarSpec("regex", "a" * 70_000), "at most 65536"),
    (GrammarSpec("json_schema", json.dumps(nested(70))), "nests more than 64"),
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 1e400}'), "not finite"),
    (GrammarSpec("json_schema", '{"anyOf": []}'), "an empty 'anyOf'"),
    (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"oneOf": []}}, '
                                '"required": ["a"]}'), "an empty 'oneOf'"),
    # xgrammar's own reason, without its assertion's wording ("Check failed: (...) is false")
    (GrammarSpec("json_schema", '{"type": "integer", "minimum": 1e30}'),
     "cannot be compiled: Integer exceeds maximum limit"),
    (GrammarSpec("json_schema", '{"type": "object", "properties": {"a": {"enum": [1, NaN]}}}'),
     "not finite"),
])
def test_grammars_it_cannot_hold_the_output_to_are_refused(tiny, spec, match):
    """Keywords xgrammar accepts but does not enforce (a violating output would pass), a
    grammar no output matches, an oversized source: a ValueError before any request runs."""
    llm = make_llm(tiny, None)
    with pytest.raises(ValueError, match=match):
        llm.generate([[1, 2]], SamplingParams(max_tokens=4, structured=spec))
    llm.engine.check_integrity()


def test_keyword_names_as_property_names_and_one_allof_subschema_are_accepted(tiny):
    schema = {"type": "object", "properties": {"not": {"type": "integer"},
                                               "if": {"allOf": [{"type": "boolean"}]}},
              "required": ["not", "if"], "additionalProperties": False}
    llm = make_llm(tiny, None)
    (out,) = llm.generate([[1, 2, 3]], SamplingParams(
        temperature=0.0, max_tokens=40, structured=GrammarSpec("json_schema",
                                                               json.dumps(schema))))
    assert out.text.startswith('{"not":'), out.text  # the random model may not finish
    if out.finish_reason == "stop":
        jsonschema.validate(json.loads(out.text), schema)


def test_a_precompiled_grammar_is_not_compiled_again_and_is_not_pickled(tiny):
    import pickle

    llm = make_llm(tiny, None)
    backend = llm.engine.grammar
    spec = GrammarSpec("regex", "(yes|no)")
    compiled = backend.compile(spec)
    assert backend.compiler.cache_limit_bytes == 256 * 1024 * 1024  # not xgrammar's unbounded
    ready = GrammarSpec("regex", "(yes|no)", compiled=compiled)
    backend.compile = None  # the engine must not compile it again
    (out,) = llm.generate([[4, 5]], SamplingParams(temperature=0.0, max_tokens=8,
                                                   structured=ready))
    assert out.text in ("yes", "no")
    assert ready == spec and pickle.loads(pickle.dumps(ready)).compiled is None


def test_a_dead_end_row_may_only_sample_the_stop_token(tiny):
    """A grammar state that allows no token (not visible at compile time) ends the output with
    a stop token instead of an arbitrary one that breaks the grammar."""
    llm = make_llm(tiny, None)
    backend = llm.engine.grammar
    bitmask = torch.zeros(2, (backend.vocab_size + 31) // 32, dtype=torch.int32)
    bitmask[1, 0] = 5  # row 1 allows tokens 0 and 2

    class _Owner:
        rid = 7

    backend._end_dead_rows(bitmask, [0, 1], [_Owner(), _Owner()])
    stop = backend.stop_ids[0]
    allowed0 = [t for t in range(backend.vocab_size)
                if int(bitmask[0, t // 32]) >> (t % 32) & 1]
    assert allowed0 == [stop] and int(bitmask[1, 0]) == 5


def test_a_regex_the_grammar_compiler_refuses_is_reported_without_its_log_prefix(tiny):
    """xgrammar's message starts "[hh:mm:ss] /path/inside/the/library.cc:NN: "; the client
    gets the reason alone."""
    llm = make_llm(tiny, None)
    with pytest.raises(ValueError, match="cannot be compiled") as e:
        llm.generate([[1, 2]], SamplingParams(structured=GrammarSpec("regex", "(a")))
    message = str(e.value)
    assert not re.search(r"\[\d\d:\d\d:\d\d\]|\.cc:\d+", message), message
    assert message.split("cannot be compiled: ", 1)[1], message  # the reason stays
