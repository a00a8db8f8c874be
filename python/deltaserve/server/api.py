"""The OpenAI-compatible HTTP API: `build_app(async_engine)` returns the FastAPI app.

Every error answers with the OpenAI error object {"error": {"message", "type", "param",
"code"}}: bad requests (validation, malformed JSON, context limit, sampling parameters, a Host
not allowed) with 400, a missing or wrong API key with 401, a cross-site POST with 403, unknown
routes with 404, a method the route does not take with 405 (and Allow), a body over the cap
with 413, a compressed body (a Content-Encoding other than identity) with 415, a shut-down
engine or a request cancelled by the server's shutdown with 503, anything unexpected with 500
(the server keeps serving). The schema is served at /openapi.json (and /docs); see
openapi.py, security.py, limits.py and shutdown.py.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from deltaserve.engine.status import spec_status
from deltaserve.server.async_engine import AsyncEngine, EngineDeadError
from deltaserve.server.body_errors import body_parse_message, validation_message
from deltaserve.server.errors import error_response
from deltaserve.server.limits import BodyLimit
from deltaserve.server.metrics import ServerMetrics
from deltaserve.server.openapi import DESCRIPTION, RESPONSES, DeltaserveAPI, generation_responses
from deltaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    InvalidRequest,
    ModelCard,
    ModelList,
)
from deltaserve.server.responses import (
    ChatCompletionChunk,
    ChatCompletionResponse,
    CompletionResponse,
)
from deltaserve.server.security import Guard, ServerOptions
from deltaserve.server.serving import ClientGone, OpenAIServing
from deltaserve.server.shutdown import LastResort

logger = logging.getLogger("deltaserve.server")

def _allowed_methods(request: Request) -> str:
    """The methods the app's routes take on the request's path, comma-separated. Starlette's
    own Allow names only the first route that matches the path (GET and HEAD of /health are
    two routes, one operation id each)."""
    methods: set[str] = set()
    for route in request.app.routes:
        match, _ = route.matches(request.scope)
        if match != Match.NONE:
            methods |= getattr(route, "methods", None) or set()
    return ", ".join(sorted(methods))


def _install_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
    def counted(response: JSONResponse) -> JSONResponse:
        metrics.errors.labels(status=str(response.status_code)).inc()
        return response

    @app.exception_handler(InvalidRequest)
    async def invalid_request(request: Request, exc: InvalidRequest) -> JSONResponse:
        logger.info("%s %s -> %d: %s", request.method, request.url.path, exc.status,
                    exc.message)
        return counted(error_response(exc.status, exc.message, exc.type, exc.param, exc.code))

    @app.exception_handler(RequestValidationError)
    async def validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = validation_message(exc, request.headers.get("content-type", ""))
        logger.info("%s %s -> 400: %s", request.method, request.url.path, message)
        return counted(error_response(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            message = f"Invalid URL ({request.method} {request.url.path})"
        elif exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI's body parse
            message = body_parse_message(exc.__cause__)
        else:
            message = str(exc.detail)
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        headers = exc.headers
        if exc.status_code == 405:  # Allow (RFC 9110) lists every route of the path
            headers = {**(headers or {}), "Allow": _allowed_methods(request)}
        return counted(error_response(exc.status_code, message, kind, headers=headers))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(request: Request, exc: EngineDeadError) -> JSONResponse:
        return counted(error_response(503, str(exc), "server_error"))

    @app.exception_handler(ClientGone)
    async def client_gone(request: Request, exc: ClientGone) -> Response:
        return Response(status_code=499)  # nobody reads it; the request was aborted


def build_app(engine: AsyncEngine, options: ServerOptions | None = None) -> FastAPI:
    """The FastAPI app serving `engine` under `options` (default: no key, any Host, the
    default body cap). The caller owns the engine (and shuts it down)."""
    options = options or ServerOptions()
    app = DeltaserveAPI(title="deltaserve", description=DESCRIPTION, docs_url="/docs",
                        redoc_url=None, openapi_url="/openapi.json",
                        api_key_required=options.api_key is not None)
    metrics = ServerMetrics()
    serving = OpenAIServing(engine, metrics)
    app.state.engine, app.state.metrics = engine, metrics
    # outermost last: LastResort (500, shutdown's 503) -> Guard (reads no body) -> BodyLimit
    # (413) -> routes
    app.add_middleware(BodyLimit, max_bytes=options.max_request_bytes)
    app.add_middleware(Guard, options=options)
    app.add_middleware(LastResort, metrics=metrics)
    _install_error_handlers(app, metrics)

    @app.post("/v1/completions", response_model=None,
              responses=generation_responses(CompletionResponse, CompletionResponse))
    async def completions(body: CompletionRequest, request: Request):
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions", response_model=None,
              responses=generation_responses(ChatCompletionResponse,
                                             ChatCompletionChunk))
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await serving.chat(body, request)

    def card() -> ModelCard:
        return ModelCard(id=engine.model_name, max_model_len=engine.max_model_len)

    @app.get("/v1/models", responses=RESPONSES["models"])
    async def models() -> ModelList:
        return ModelList(data=[card()])

    # OpenAI's "retrieve model"; ids may hold slashes (Qwen/Qwen3-Next-80B-A3B-Instruct)
    @app.get("/v1/models/{model:path}", responses=RESPONSES["model"])
    async def model(model: str) -> ModelCard:
        serving.check_model(model, default_ok=False)  # GET /v1/models/ names no model
        return card()

    # one operation id per method: the schema's ids must be unique
    @app.head("/health", operation_id="health_head", responses=RESPONSES["health"])
    @app.get("/health", operation_id="health", responses=RESPONSES["health"])
    async def health() -> Response:
        if not engine.alive:
            why = engine.failure or "the engine thread is not running"
            return error_response(503, why, "server_error")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics", responses=RESPONSES["metrics"])
    async def prometheus() -> Response:
        status, spec = await engine.call(lambda e: (e.cache_status(), spec_status(e)))
        text = metrics.render(status, engine.num_inflight, spec)
        return Response(text, media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/cache/status", responses=RESPONSES["cache_status"])
    async def cache_status() -> JSONResponse:
        return JSONResponse(await engine.call(lambda e: e.cache_status()))

    @app.post("/v1/cache/flush", responses=RESPONSES["cache_flush"])
    async def cache_flush() -> JSONResponse:
        def flush(e) -> dict:
            e.flush_cache()
            return e.cache_status()

        status = await engine.call(flush)
        logger.info("prefix cache flushed")
        return JSONResponse({"flushed": True, "cache_status": status})

    return app
