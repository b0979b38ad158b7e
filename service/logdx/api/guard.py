"""Who may talk to the service from a browser: nobody it did not name.

A web page in a browser on a machine that can reach logdx must not drive it. Three checks, before
any route runs (and before any per-request metric series exists):

- **Host** (DNS rebinding): a page at `http://evil.example` whose name is re-pointed at 127.0.0.1
  sends `Host: evil.example`. Only the bind address, `localhost`, loopback addresses,
  `server.allowed_hosts` and, on a wildcard bind, IP addresses and the machine's name are answered
  (names are matched by Starlette's `TrustedHostMiddleware`).
- **Origin** (cross-site requests): a request from a page of any origin but the service's own or
  `server.allowed_origins` is refused.
- **Browser-simple writes**: a POST that a page can send without a CORS preflight (a form or
  `text/plain` body, no custom header) is refused unless it carries a bearer token, a non-form
  content type (`application/json`, `application/x-ndjson`...), `Content-Encoding`,
  `Idempotency-Key` or any `X-` header: each of those makes a browser ask first, and logdx never
  answers a preflight. Shippers and curl send one of them (the token, or `X-Logdx-*`).

Methods outside the HTTP set logdx knows get 405 here, so a random method never names a metric.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Callable
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.middleware.trustedhost import TrustedHostMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from logdx.api.errors import error_response
from logdx.config import ServerSettings

KNOWN_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
_WILDCARD_BINDS = frozenset({"", "0.0.0.0", "::", "[::]"})
# Content types a page may POST without a preflight (the Fetch standard's CORS-safelisted ones).
_SIMPLE_TYPES = frozenset({"", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"})
# Headers a page cannot send without a preflight; any one of them proves the request is not simple.
_PREFLIGHTED = ("authorization", "content-encoding", "idempotency-key")
REFUSAL_REASONS = ("method", "host", "origin", "simple_request")
_HOST_CHARS = re.compile(r"[A-Za-z0-9._-]+(:[0-9]{1,5})?|\[[0-9A-Fa-f:.]+\](:[0-9]{1,5})?")


class HostPolicy:
    """The Host names this service answers to. Names are judged by Starlette's `TrustedHostMiddleware`
    (exact names, `*.example.com`, `*`); IP addresses here, since it has no rule for "any loopback
    address" or "any address on a wildcard bind". The refusal is ours (a JSON body, a counted reason)."""

    def __init__(self, patterns: list[str], any_ip: bool, ips: frozenset[str]) -> None:
        self.any_ip = any_ip
        self.ips = ips
        self._names = TrustedHostMiddleware(_host_allowed, allowed_hosts=patterns, www_redirect=False)

    @classmethod
    def from_settings(cls, server: ServerSettings) -> HostPolicy:
        bind = server.host.strip().lower()
        wildcard = bind in _WILDCARD_BINDS
        names = {"localhost"}
        ips = {"127.0.0.1", "::1"}
        if _ip(bind) is not None:
            ips.add(str(_ip(bind)))
        elif not wildcard:
            names.add(bind.rstrip("."))
        if wildcard:
            names.add(socket.gethostname().lower())
        allowed = [h.strip().lower().rstrip(".") for h in server.allowed_hosts if h.strip()]
        # Starlette's patterns: a name, "*.suffix" or "*" (anything else with a "*" never names a host)
        patterns = sorted(names) + [h for h in allowed if "*" not in h or h == "*" or
                                    (h.startswith("*.") and "*" not in h[1:])]
        return cls(patterns, wildcard, frozenset(ips))

    def allows(self, host: str) -> bool:
        """`host` is a Host header's name part (no port), lower case."""
        ip = _ip(host)
        if ip is not None:
            return self.any_ip or ip.is_loopback or str(ip) in self.ips
        scope: Scope = {"type": "http", "headers": [(b"host", host.rstrip(".").encode())]}
        # The middleware awaits nothing but `_host_allowed` or its refusal into `_discard`: it finishes
        # on the first step, so it is run here without an event loop.
        step = self._names(scope, _no_body, _discard)
        try:
            step.send(None)
        except StopIteration:
            pass
        else:  # pragma: no cover - it never suspends
            step.close()
            return False
        return bool(scope.get("logdx.host_allowed"))


async def _host_allowed(scope: Scope, _receive: Receive, _send: Send) -> None:
    scope["logdx.host_allowed"] = True


async def _no_body() -> Message:
    return {"type": "http.disconnect"}


async def _discard(_message: Message) -> None:
    return None


def split_host(value: str) -> tuple[str, int | None] | None:
    """`name[:port]` or `[v6][:port]` as (lower-case name, port); None when malformed."""
    if not _HOST_CHARS.fullmatch(value):
        return None
    try:
        parsed = urlsplit(f"//{value}")
        port = parsed.port
    except ValueError:  # "[::1", a port out of range
        return None
    host = parsed.hostname
    return (host, port) if host else None


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host.strip("[]"))
    except ValueError:
        return None


def same_origin(origin: str, host: tuple[str, int | None]) -> bool:
    """The Origin names the host (and port, when both say one) the request was sent to."""
    try:
        parts = urlsplit(origin)
        port = parts.port
    except ValueError:
        return False
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return False
    name, host_port = host
    return parts.hostname.lower() == name and (port is None or host_port is None or port == host_port)


def is_browser_simple(headers: Headers) -> bool:
    """A POST a web page could send without asking the server first (no CORS preflight)."""
    content_type = headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if content_type not in _SIMPLE_TYPES:
        return False
    return not any(name in headers for name in _PREFLIGHTED) and not any(
        name.lower().startswith("x-") for name in headers)


class RequestGuard:
    """The pure ASGI middleware that applies the checks above; `on_refused(reason)` counts refusals
    (reasons: `REFUSAL_REASONS`)."""

    def __init__(self, app: ASGIApp, server: ServerSettings,
                 on_refused: Callable[[str], None] | None = None) -> None:
        self.app = app
        self.hosts = HostPolicy.from_settings(server)
        self.origins = frozenset(o.strip().rstrip("/").lower() for o in server.allowed_origins if o.strip())
        self.token_set = bool(server.token or server.tokens)
        self.on_refused = on_refused

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope["method"], Headers(scope=scope))
        if refusal is None:
            await self.app(scope, receive, send)
            return
        reason, status, code, message = refusal
        if self.on_refused is not None:
            self.on_refused(reason)
        extra = {"allow": ", ".join(sorted(KNOWN_METHODS))} if reason == "method" else None
        await error_response(status, code, message, extra)(scope, receive, send)

    def refusal(self, method: str, headers: Headers) -> tuple[str, int, str, str] | None:
        """(reason, status, code, message) when the request is refused, else None."""
        if method not in KNOWN_METHODS:
            return "method", 405, "method_not_allowed", f"unknown HTTP method {method[:32]!r}"
        raw_host = headers.get("host")
        host = split_host(raw_host) if raw_host is not None else None
        if raw_host is not None and (host is None or not self.hosts.allows(host[0])):
            return ("host", 400, "host_not_allowed",
                    f"this server does not answer to Host {raw_host[:100]!r}; add the name to server.allowed_hosts "
                    "(LOGDX_SERVER__ALLOWED_HOSTS) if it is really this server's")
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            return ("origin", 403, "origin_not_allowed",
                    f"requests from web pages of {origin[:100]!r} are refused; list trusted origins in "
                    "server.allowed_origins")
        if method == "POST" and not self.token_set and is_browser_simple(headers):
            return ("simple_request", 403, "simple_request_refused",
                    "a POST with a form or text/plain body and no custom header could come from any web page; "
                    "send the bearer token, Content-Type: application/json or application/x-ndjson, or any "
                    "X- header (for instance X-Logdx-Host)")
        return None

    def _origin_allowed(self, origin: str, host: tuple[str, int | None] | None) -> bool:
        if origin.strip().rstrip("/").lower() in self.origins:
            return True
        return host is not None and same_origin(origin, host)
