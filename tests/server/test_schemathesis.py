"""Schemathesis against the published /openapi.json of the live test server: requests made
from the schema (valid ones and deliberately invalid ones), each answer checked against the
schema. Bounded: a fixed number of examples per operation, derandomized (a fixed seed), so a
run on two CPU cores takes a minute or two and fails the same way every time."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

# what "true to the server" means here: no 5xx, every status, content type, header and body
# as documented, and invalid requests refused with a 4xx. positive_data_acceptance is left out:
# requests the schema admits may still be refused (n > 1, a prompt over the context).
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance, negative_data_rejection]
EXAMPLES = 25


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"),
              ("HEAD", "/health"), ("GET", "/metrics"), ("GET", "/v1/cache/status"),
              ("POST", "/v1/cache/flush")]


def served_body(body: dict, stream: bool) -> dict:
    """`body` cut down to SERVED_FIELDS, streamed or not, with a small max_tokens when it has
    none (chat would generate up to the context); each message keeps its role and its content
    when that is a non-empty string (else "Hi"), so that most chat requests reach the engine."""
    out = {k: v for k, v in body.items() if k in SERVED_FIELDS}
    if "messages" in out:
        messages = [m for m in out["messages"] if isinstance(m, dict)] if isinstance(
            out["messages"], list) else []
        out["messages"] = [{"role": m.get("role", "user"),
                            "content": m["content"] if isinstance(m.get("content"), str)
                            and m["content"] else "Hi"} for m in messages] or \
            [{"role": "user", "content": "Hi"}]
    out["stream"] = stream
    if not isinstance(out.get("max_tokens"), int):
        out["max_tokens"] = 4
    return out


@pytest.fixture(scope="module")
def api_schema(served):
    return schemathesis.openapi.from_url(f"{served.base_url}/openapi.json")


def test_the_schema_lists_exactly_the_routes_tested_here(api_schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


# "served": a schema-valid body cut down (served_body) so that most requests reach the engine
# and 200 answers (JSON and SSE) get checked too; most raw bodies set something refused (n,
# tools, an unknown model). Invalid requests exist only where a body is taken.
SERVED_FIELDS = {"prompt", "messages", "max_tokens", "stream", "stop", "seed", "ignore_eos"}
GENERATION = [(m, p) for m, p in OPERATIONS if p.endswith("completions")]
CASES = [(m, p, "positive") for m, p in OPERATIONS] + \
    [(m, p, mode) for m, p in GENERATION for mode in ("served", "negative")]


@pytest.fixture(scope="module")
def keyed_schema(keyed):
    return schemathesis.openapi.from_url(f"{keyed}/openapi.json")


def run_cases(schema, method: str, path: str, mode: str, examples: int) -> None:
    """Call the server with `examples` cases of `mode` for one operation; check each answer."""
    operation = schema[path][method]
    served = mode == "served"
    generation_mode = schemathesis.GenerationMode("positive" if served else mode)
    strategy = operation.as_strategy(generation_mode=generation_mode)

    @given(case=strategy)
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    def check(case) -> None:
        if isinstance(case.body, dict):
            if served:
                case.body = served_body(case.body, stream=len(statuses) % 2 == 0)
            if isinstance(case.body.get("max_tokens"), int):  # bounded generation
                case.body["max_tokens"] = min(case.body["max_tokens"], 4)
        statuses.append(case.call_and_validate(checks=CHECKS).status_code)

    statuses: list[int] = []

    check()
    if served:  # the cut-down bodies reach the engine, and its answers are checked
        assert 200 in statuses, statuses


@pytest.mark.parametrize("method,path,mode", CASES, ids=[" ".join(c) for c in CASES])
def test_every_answer_matches_the_published_schema(api_schema, method, path, mode):
    run_cases(api_schema, method, path, mode, 2 * EXAMPLES if mode == "served" else EXAMPLES)


@pytest.mark.parametrize("method,path", OPERATIONS, ids=[f"{m} {p}" for m, p in OPERATIONS])
def test_a_keyed_server_answers_keyless_requests_as_its_schema_says(keyed_schema, method, path):
    run_cases(keyed_schema, method, path, "positive", 5)  # 401 everywhere but /health
