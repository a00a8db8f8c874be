"""Who may call the server: the API key, the Host header check and the cross-site (CSRF)
guard, as one ASGI middleware in front of every route (`Guard`), configured by
`ServerOptions`.

- API key (`--api-key`, env DELTASERVE_API_KEY), as vLLM: every `/v1/*` route and `/metrics`
  need `Authorization: Bearer KEY`, else 401 with the OpenAI error object. `/health`, `/docs`
  and `/openapi.json` stay open (probes and clients read them before they hold a key). The
  cache admin routes (`/v1/cache/status`, `POST /v1/cache/flush`) are under `/v1`, so behind
  the key: one switch protects everything that reads or changes the server's state.
- Host header (`--allowed-hosts`): a request whose Host is not listed gets 400. Without the
  flag, a server bound to loopback accepts only loopback names (a DNS-rebinding page in a
  browser sends its own name), and a server bound beyond loopback accepts any name.
- CSRF: a browser on another site can POST without asking (no preflight) when the body is
  text/plain or a form; such a POST carries an Origin (or Sec-Fetch-Site) naming another
  site. Every POST whose Origin is not this server's own, or whose Sec-Fetch-Site is
  cross-site, gets 403; a POST to the admin routes with a body that is not JSON gets 403 too
  (the generation routes already refuse such a body with 400).
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.types import ASGIApp, Receive, Scope, Send

from deltaserve.server.errors import error_response
from deltaserve.server.limits import DEFAULT_MAX_REQUEST_BYTES

logger = logging.getLogger("deltaserve.server")

LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
ADMIN_PREFIX = "/v1/cache/"
OPEN_PATHS = frozenset({"/health", "/docs", "/docs/oauth2-redirect", "/openapi.json"})
# the Content-Types a cross-site page may POST without a CORS preflight (Fetch standard)
_SIMPLE_TYPES = ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data")


@dataclass(frozen=True)
class ServerOptions:
    """The HTTP server's own settings (the engine's are EngineConfig).

    api_key: the Bearer token every /v1 route and /metrics need; None: no key (open).
    allowed_hosts: Host header names accepted (lowercase, no port); "*" accepts any, and an
        entry starting with "." also accepts its subdomains (".example.com").
    max_request_bytes: the request-body cap in bytes (413 past it).
    """

    api_key: str | None = None
    allowed_hosts: tuple[str, ...] = ("*",)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES

    def __post_init__(self) -> None:
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("--api-key must not be empty")
        if self.max_request_bytes < 1024:
            raise ValueError("--max-request-bytes must be at least 1024, got "
                             f"{self.max_request_bytes}")
        if not self.allowed_hosts:
            raise ValueError("--allowed-hosts must name at least one host (or '*')")

    @classmethod
    def for_bind(cls, bind_host: str, *, api_key: str | None = None,
                 allowed_hosts: list[str] | None = None,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> ServerOptions:
        """Options for a server listening on `bind_host`: `allowed_hosts` when given (comma-
        separated entries are split), else the loopback names for a loopback bind and any name
        otherwise. Raises ValueError for an empty key, a cap under 1 KiB or an empty list."""
        if allowed_hosts:
            hosts = tuple(host_name(h) for item in allowed_hosts for h in item.split(",")
                          if h.strip())
        else:
            hosts = LOOPBACK_NAMES if is_loopback(bind_host) else ("*",)
        return cls(api_key=api_key, allowed_hosts=hosts, max_request_bytes=max_request_bytes)


def is_loopback(host: str) -> bool:
    """Whether binding `host` listens on loopback only ("localhost", 127.0.0.0/8, ::1)."""
    return host.lower() == "localhost" or _loopback_address(host.strip("[]"))


def _loopback_address(name: str) -> bool:
    """Whether `name` is a loopback IP address literal; False for any name (one that resolves
    elsewhere, or "": all interfaces)."""
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def host_name(host_header: str) -> str:
    """The name part of a Host header value, lowercase, without the fully qualified form's
    final dot (RFC 1034 3.1: "localhost." names "localhost"): "[::1]:8000" -> "::1"."""
    value = host_header.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    name, sep, port = value.rpartition(":")
    name = name if sep and port.isdigit() and ":" not in name else value
    return name[:-1] if name.endswith(".") and not name.endswith("..") else name


def host_allowed(name: str, allowed: tuple[str, ...]) -> bool:
    """Whether the Host name `name` matches an entry of `allowed` (see ServerOptions). A
    loopback address literal (127.0.0.0/8, ::1) matches an allowed loopback address: a
    DNS-rebinding page sends its own domain name, never an address."""
    for entry in allowed:
        if entry == "*" or name == entry:
            return True
        if _loopback_address(entry) and _loopback_address(name):
            return True
        if entry.startswith(".") and (name == entry[1:] or name.endswith(entry)):
            return True
    return False


class Guard:
    """ASGI middleware applying `options` (Host check, API key, CSRF) before any route runs,
    in that order; each refusal is an OpenAI error object and reads no body."""

    def __init__(self, app: ASGIApp, options: ServerOptions) -> None:
        self.app, self.options = app, options

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"]}
        response = self.refusal(scope["method"], scope["path"], headers)
        if response is None:
            await self.app(scope, receive, send)
            return
        logger.info("%s %s -> %d: %s", scope["method"], scope["path"], response.status_code,
                    response.body.decode("utf-8", "replace"))
        await response(scope, receive, send)

    def refusal(self, method: str, path: str, headers: dict[str, str]):
        """The error response refusing the request, or None to let it through. `headers`:
        lowercase names (the last value of a repeated header)."""
        host = host_name(headers.get("host", ""))
        if not host_allowed(host, self.options.allowed_hosts):
            return error_response(400, f"Host {host or '(none)'!r} is not served here: pass it "
                                       "to --allowed-hosts", param="Host",
                                  code="invalid_host")
        if self.options.api_key is not None and _needs_key(path):
            refused = _key_refusal(headers.get("authorization", ""), self.options.api_key)
            if refused is not None:
                return refused
        if method == "POST":
            return _csrf_refusal(path, headers)
        return None


def _needs_key(path: str) -> bool:
    return path not in OPEN_PATHS and (path == "/v1" or path.startswith("/v1/")
                                       or path == "/metrics")


def _key_refusal(authorization: str, api_key: str):
    scheme, _, token = authorization.strip().partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        # a header in another form is not "no key": say which form is wanted (the header's
        # value is never echoed back, it may be the key)
        said = ("The Authorization header is not a Bearer token" if authorization.strip()
                else "You didn't provide an API key")
        return error_response(401, f"{said}: send it as 'Authorization: Bearer YOUR_KEY'",
                              headers=challenge)
    # constant time: the comparison must not tell how many leading characters were right
    if not hmac.compare_digest(token.strip().encode(), api_key.encode()):
        return error_response(401, "Incorrect API key provided", code="invalid_api_key",
                              headers=challenge)
    return None


def _csrf_refusal(path: str, headers: dict[str, str]):
    origin = headers.get("origin")
    if origin is not None:
        own = headers.get("host", "").strip().lower()
        if urlsplit(origin.strip().lower()).netloc != own or not own:
            return error_response(403, f"cross-site POST refused: Origin {origin!r} is not "
                                       "this server", code="cross_site_request")
    if headers.get("sec-fetch-site", "").strip().lower() == "cross-site":
        return error_response(403, "cross-site POST refused (Sec-Fetch-Site: cross-site)",
                              code="cross_site_request")
    media = headers.get("content-type", "").split(";")[0].strip().lower()
    if path.startswith(ADMIN_PREFIX) and media and media != "application/json":
        kind = " (a form or text a cross-site page can send)" if media in _SIMPLE_TYPES else ""
        return error_response(403, f"POST {path} takes no body or a JSON one, not "
                                   f"{media}{kind}", code="cross_site_request")
    return None


API_KEY_ENV = "DELTASERVE_API_KEY"


def add_server_flags(serve: argparse.ArgumentParser) -> None:
    """The `serve` flags of ServerOptions: --api-key, --allowed-hosts, --max-request-bytes."""
    group = serve.add_argument_group("server security and limits")
    group.add_argument("--api-key", default=None,
                       help=f"require 'Authorization: Bearer KEY' on every /v1 route and "
                            f"/metrics (default: ${API_KEY_ENV}, else none)")
    group.add_argument("--allowed-hosts", action="append", default=None, metavar="HOSTS",
                       help="Host header names accepted, comma-separated or repeated ('*': "
                            "any; '.example.com': it and its subdomains); default: loopback "
                            "names when --host is loopback, else any")
    group.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                       help="request-body cap in bytes, at least 1024; larger bodies get 413 "
                            f"(default {DEFAULT_MAX_REQUEST_BYTES}: 16 MiB)")


def server_options(args: argparse.Namespace,
                   environ: Mapping[str, str] = os.environ, warn: bool = True) -> ServerOptions:
    """ServerOptions from the `serve` flags (the key falls back to $DELTASERVE_API_KEY).
    Raises ValueError for a bad value; with `warn`, logs a warning when the server listens
    beyond loopback with no key (`warn_if_open`: the same, later)."""
    key = args.api_key if args.api_key is not None else environ.get(API_KEY_ENV) or None
    options = ServerOptions.for_bind(args.host, api_key=key, allowed_hosts=args.allowed_hosts,
                                     max_request_bytes=args.max_request_bytes)
    if warn:
        warn_if_open(args.host, options)
    return options


def warn_if_open(host: str, options: ServerOptions) -> None:
    """Log a warning when a server on `host` (beyond loopback) takes requests with no key."""
    if not is_loopback(host) and options.api_key is None:
        logger.warning("listening on %s without --api-key: anyone who reaches it can generate, "
                       "read /metrics and flush the cache", host)
