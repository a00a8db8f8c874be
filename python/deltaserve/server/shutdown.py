"""Shutting the server down without dropping requests on the floor.

Ctrl-C (or SIGTERM) on `deltaserve serve`: `graceful_server` gives running requests
ENGINE_STOP_S seconds, then stops the engine, and each request still running ends with the
engine's error (a 503 error object, or an error event then [DONE] in a stream). The request
tasks still running are cancelled when uvicorn's own grace period runs out (by uvicorn), on a
second Ctrl-C or SIGTERM (force quit: by `graceful_server`, since uvicorn leaves them) and by
asyncio when the loop closes: `LastResort`, the outermost middleware, ends such a request the
same documented way instead of uvicorn's plain-text 500 and logged traceback (and answers an
unhandled exception with a 500 error object).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import TYPE_CHECKING

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from deltaserve.server.errors import error_object, error_response
from deltaserve.server.serving import sse

if TYPE_CHECKING:
    from deltaserve.server.async_engine import AsyncEngine
    from deltaserve.server.metrics import ServerMetrics

logger = logging.getLogger("deltaserve.server")

SHUTDOWN_GRACE_S = 5  # seconds uvicorn waits for open connections after Ctrl-C
ENGINE_STOP_S = SHUTDOWN_GRACE_S - 1  # then requests still running end with an error
# how long a cancelled request may take to send its answer (a client that does not read)
ANSWER_TIMEOUT_S = 1.0
CANCELLED_MESSAGE = "the server shut down before the request finished"


def graceful_server(config, engine: AsyncEngine, stop_after: float = ENGINE_STOP_S):
    """A uvicorn.Server for `config` that, on the first exit signal (Ctrl-C, SIGTERM), gives
    requests `stop_after` seconds to finish and then stops `engine`. Each request still
    running then ends as an answer (503 JSON, or an error event and [DONE] in a stream)
    before uvicorn's grace period runs out. A second Ctrl-C or SIGTERM quits at once
    (uvicorn's force quit, which uvicorn itself gives a second SIGINT only): the request tasks
    are cancelled and LastResort answers them the same way. Either way `engine` is stopped
    before the server returns (and uvicorn re-raises the signal it caught)."""
    import uvicorn

    class Server(uvicorn.Server):
        stop_timer: threading.Timer | None = None

        def handle_exit(self, sig, frame) -> None:
            if self.stop_timer is None:
                self.stop_timer = threading.Timer(stop_after, engine.shutdown)
                self.stop_timer.daemon = True
                self.stop_timer.start()
            elif sig == signal.SIGTERM:  # a supervisor's second request to stop: as Ctrl-C's
                self.force_exit = True
            super().handle_exit(sig, frame)

        async def shutdown(self, sockets=None) -> None:
            await super().shutdown(sockets)
            if self.force_exit:
                # uvicorn leaves the request tasks running on a force quit and re-raises the
                # signals it caught as serve() returns, in the loop: SIGINT's interrupt lets
                # asyncio.run cancel them (LastResort answers), SIGTERM's default action kills
                # the process first, leaving empty replies. So cancel them here, SIGINT or not.
                running = [t for t in self.server_state.tasks if not t.done()]
                for t in running:
                    t.cancel()
                if running:
                    await asyncio.wait(running, timeout=2 * ANSWER_TIMEOUT_S)
                # uvicorn skips it; the lifespan task would be cancelled and starlette would
                await self.lifespan.shutdown()  # log that as a traceback
            if self.stop_timer is not None:  # the requests ended first: it has no work left
                self.stop_timer.cancel()
            # before uvicorn re-raises the signal: the engine's loop ends its step and stops
            # (tensor-parallel workers then see rank 0 leave between steps, not inside one)
            await asyncio.to_thread(engine.shutdown)

    return Server(config)


class LastResort:
    """ASGI middleware, outermost: a request the app ended without answering still gets an
    answer. An unhandled exception is a 500 OpenAI error object, logged once (the server
    keeps serving). A cancelled request task (server shutdown; uvicorn never cancels a request
    because its client left) is a 503; the CancelledError ends here: this is the task's
    outermost frame and the task ends right after the answer, which gets at most
    ANSWER_TIMEOUT_S; its engine request was aborted on the way out (RequestStream's
    iteration aborts it when left). In an event stream already under way the answer is an
    error event then [DONE]; other responses under way get nothing more."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        sent = _Sent()

        async def tracking(message: Message) -> None:
            sent.see(message)
            await send(message)

        where = f"{scope.get('method')} {scope.get('path')}"
        try:
            await self.app(scope, receive, tracking)
            return
        except asyncio.CancelledError:
            if sent.complete:
                return
            logger.info("%s: cancelled by the server's shutdown; answered 503", where)
            status, message = 503, CANCELLED_MESSAGE
        except Exception as e:
            logger.exception("internal error on %s", where)
            status, message = 500, f"internal server error: {type(e).__name__}: {e}"
        self.metrics.errors.labels(status=str(status)).inc()
        try:
            async with asyncio.timeout(ANSWER_TIMEOUT_S):
                await _answer(sent, status, message, scope, receive, send)
        except (asyncio.CancelledError, TimeoutError, OSError):
            pass  # cancelled again, or the client does not read: the connection closes


class _Sent:
    """What the app has sent of its response so far."""

    def __init__(self) -> None:
        self.started = self.complete = self.event_stream = False

    def see(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.started = True
            content_type = dict(message.get("headers", ())).get(b"content-type", b"")
            self.event_stream = content_type.startswith(b"text/event-stream")
        elif message["type"] == "http.response.body" and not message.get("more_body", False):
            self.complete = True


async def _answer(sent: _Sent, status: int, message: str, scope: Scope, receive: Receive,
                  send: Send) -> None:
    """The error response of a request whose response has not started; in an event stream
    (whose every body message is whole events), the error event and [DONE]."""
    if not sent.started:
        await error_response(status, message, "server_error")(scope, receive, send)
        return
    if not sent.event_stream or sent.complete:  # nothing sane to add to a response under way
        return
    events = sse(error_object(message, "server_error")) + "data: [DONE]\n\n"
    await send({"type": "http.response.body", "body": events.encode(), "more_body": False})
