"""The published schema (/openapi.json, /docs): FastAPI's, made true to what the server does.

FastAPI documents a 422 validation error the server never sends (it answers 400 with the OpenAI
error object) and knows neither the middlewares' answers (401, 403, 413, 415, Host 400) nor the
non-JSON bodies: SSE streams (each event's data a chunk as JSON, or [DONE]) and Prometheus
text. `RESPONSES` and `generation_responses` hold the per-route documentation the routes pass
to their decorators; `DeltaserveAPI.openapi()` drops the 422s, adds the models only the SSE
events name, and declares the bearer scheme when a key is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST

from deltaserve.server.protocol import ErrorResponse
from deltaserve.server.responses import ChatCompletionChunk

PROMETHEUS_MEDIA = CONTENT_TYPE_LATEST.split(";")[0]  # text/plain
_ERROR = {"model": ErrorResponse}
_WHY = {
    400: "Bad request: validation, malformed JSON, context limit, a Host not in "
         "--allowed-hosts",
    401: "Missing or wrong API key (only when the server has --api-key)",
    403: "Cross-site POST refused (Origin or Sec-Fetch-Site of another site)",
    404: "Unknown model",
    413: "Request body over --max-request-bytes",
    415: "Request body in a Content-Encoding other than identity (gzip, ...)",
    500: "Internal error (the server keeps serving)",
    503: "The engine is stopped or stopping",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {**_ERROR, "description": _WHY[code]} for code in codes}


_GENERATION = (400, 401, 403, 404, 413, 415, 500, 503)


def _sse_event(chunk: type) -> dict[str, Any]:
    """The schema of one server-sent event of a stream of `chunk`s (OpenAPI 3.1: the media
    type's schema describes each event): its data is a chunk as JSON, an error object as JSON
    (an error after the headers went out), or the closing "[DONE]"."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{m.__name__}"}
                         for m in (chunk, ErrorResponse)]}
    return {"type": "object", "required": ["data"], "properties": {"data": {"anyOf": [
        {"const": "[DONE]"},
        {"type": "string", "contentMediaType": "application/json", "contentSchema": payload},
    ]}}}


def generation_responses(model: type, chunk: type) -> dict[int | str, dict[str, Any]]:
    """The responses of a generation route: `model` as JSON, or with stream: true an SSE
    stream of `chunk`s then [DONE]; and its errors."""
    ok = {"model": model, "description": "The completion; with stream: true, a "
          "text/event-stream of chunks ('data: {json}' events, then 'data: [DONE]')",
          "content": {"text/event-stream": {"schema": _sse_event(chunk)}}}
    return {200: ok, **_errors(*_GENERATION)}


RESPONSES: dict[str, dict[int | str, dict[str, Any]]] = {
    "models": _errors(400, 401, 500),
    "model": _errors(400, 401, 404, 500),
    "health": {200: {"description": "The engine is running",
                     "content": {"application/json": {"schema": {
                         "type": "object", "properties": {"status": {"const": "ok"}},
                         "required": ["status"]}}}},
               **_errors(400, 503)},
    "metrics": {200: {"description": "Prometheus text exposition",
                      "content": {PROMETHEUS_MEDIA: {"schema": {"type": "string"}}}},
                **_errors(400, 401, 500, 503)},
    "cache_status": {200: {"description": "Page pool, state pool, host bank and prefix cache "
                                          "counters (numbers keyed by name)",
                           "content": {"application/json": {"schema": {"type": "object"}}}},
                     **_errors(400, 401, 500, 503)},
    "cache_flush": {200: {"description": "The prefix cache was emptied",
                          "content": {"application/json": {"schema": {
                              "type": "object", "required": ["flushed", "cache_status"],
                              "properties": {"flushed": {"type": "boolean"},
                                             "cache_status": {"type": "object"}}}}}},
                    **_errors(400, 401, 403, 415, 500, 503)},
}

DESCRIPTION = (
    "OpenAI-compatible API of deltaserve. Every error is the OpenAI error object "
    "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`. A method a path does not "
    "list gets 405 with an `Allow` header; an unknown path 404. With `--api-key`, every "
    "`/v1/*` route and `/metrics` need `Authorization: Bearer KEY` (401 otherwise)."
)


STREAM_MODELS = (ChatCompletionChunk, ErrorResponse)


class DeltaserveAPI(FastAPI):
    """FastAPI whose schema leaves out the 422 responses (validation errors are 400 here) and
    declares the bearer scheme on the keyed routes when `api_key_required`."""

    def __init__(self, *, api_key_required: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.api_key_required = api_key_required

    def openapi(self) -> dict[str, Any]:
        if self.openapi_schema is not None:
            return self.openapi_schema
        schema = super().openapi()
        for path, item in schema.get("paths", {}).items():
            for operation in item.values():
                operation.get("responses", {}).pop("422", None)
                if self.api_key_required and (path.startswith("/v1") or path == "/metrics"):
                    operation["security"] = [{"bearer": []}]
        components = schema.setdefault("components", {})
        schemas = components.setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            schemas.pop(name, None)
        for model in STREAM_MODELS:  # named by the SSE events only, which FastAPI cannot see
            own = model.model_json_schema(mode="serialization",
                                          ref_template="#/components/schemas/{model}")
            for name, definition in {**own.pop("$defs", {}), model.__name__: own}.items():
                schemas.setdefault(name, definition)
        if self.api_key_required:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        self.openapi_schema = schema
        return schema
