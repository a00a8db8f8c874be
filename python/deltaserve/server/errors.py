"""The OpenAI error object as a response: shared by the routes and the ASGI middlewares.

Its schema is `protocol.ErrorResponse`; this module builds the same body as a plain dict so
that the middlewares (and `limits`, which `protocol` imports) need not import `protocol`.
"""

from __future__ import annotations

from fastapi.responses import JSONResponse


def error_object(message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}}: the body of an error response, and the
    payload of a stream's error event."""
    # a message may quote client text holding lone surrogates, which JSON cannot encode
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def error_response(status: int, message: str, type: str = "invalid_request_error",
                   param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """A JSONResponse with status `status` and body error_object(...), as OpenAI's API
    answers errors; `headers` are added to the response."""
    return JSONResponse(error_object(message, type, param, code), status_code=status,
                        headers=headers)
