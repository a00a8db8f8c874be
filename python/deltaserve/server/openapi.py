"""The published schema (/openapi.json, /docs): FastAPI's, made true to what the server does.

FastAPI documents a 422 validation error the server never sends (it answers 400 with the OpenAI
error object) and knows neither the middlewares' answers (401, 403, 413, Host 400) nor the
non-JSON bodies (SSE streams, Prometheus text). `RESPONSES` holds the per-route documentation
the routes pass to their decorators; `DeltaserveAPI.openapi()` drops the 422s and adds the
bearer scheme when a key is set.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST

from deltaserve.server.protocol import ErrorResponse

PROMETHEUS_MEDIA = CONTENT_TYPE_LATEST.split(";")[0]  # text/plain
_ERROR = {"model": ErrorResponse}
_WHY = {
    400: "Bad request: validation, malformed JSON, context limit, a Host not in "
         "--allowed-hosts",
    401: "Missing or wrong API key (only when the server has --api-key)",
    403: "Cross-site POST refused (Origin or Sec-Fetch-Site of another site)",
    404: "Unknown model",
    413: "Request body over --max-request-bytes",
    500: "Internal error (the server keeps serving)",
    503: "The engine is stopped or stopping",
}


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    return {code: {**_ERROR, "description": _WHY[code]} for code in codes}


def _stream_or(model: type, what: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is `model` as JSON, or an SSE stream when the request set stream: true."""
    return {200: {"model": model, "description": f"{what}; with stream: true, a "
                  "text/event-stream of chunks ('data: {json}' events, then 'data: [DONE]')",
                  "content": {"text/event-stream": {"schema": {"type": "string"}}}}}


_GENERATION = (400, 401, 403, 404, 413, 500, 503)


def generation_responses(model: type) -> dict[int | str, dict[str, Any]]:
    """The responses of a generation route answering `model` as JSON, or an SSE stream (its
    events are described in words: OpenAPI 3.1 has no schema for an event stream)."""
    return {**_stream_or(model, "The completion"), **_errors(*_GENERATION)}


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
                    **_errors(400, 401, 403, 500, 503)},
}

DESCRIPTION = (
    "OpenAI-compatible API of deltaserve. Every error is the OpenAI error object "
    "`{\"error\": {\"message\", \"type\", \"param\", \"code\"}}`. A method a path does not "
    "list gets 405 with an `Allow` header; an unknown path 404. With `--api-key`, every "
    "`/v1/*` route and `/metrics` need `Authorization: Bearer KEY` (401 otherwise)."
)


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
        for name in ("HTTPValidationError", "ValidationError"):
            components.get("schemas", {}).pop(name, None)
        if self.api_key_required:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
        self.openapi_schema = schema
        return schema
