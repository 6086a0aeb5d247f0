"""The guard every leanlm HTTP process puts in front of its routes (`leanlm serve` and the fleet's front): the
Host check against DNS rebinding, the bearer key, JSON-only bodies and the body-size limit."""

from __future__ import annotations

import hmac
import ipaddress

from fastapi.responses import JSONResponse

from leanlm.server.error_body import error_response


class GuardMiddleware:
    """Pure ASGI (it must not buffer streams). In order: the Host check, the bearer key (compared in constant
    time) on /v1 routes and /metrics, the JSON Content-Type of POST bodies, and a 413 for request bodies over
    `max_bytes`, whether announced by Content-Length or streamed.

    Why the first and third: a web page in the user's browser can POST to http://127.0.0.1:8000 (a "simple"
    cross-site request needs no CORS preflight if its Content-Type is text/plain or a form), and with DNS
    rebinding it can even read the answers, its own host name then resolving to 127.0.0.1. Requiring
    application/json forces the preflight (which this server does not grant); refusing Host names other than
    loopback ones defeats the rebinding. With an API key the page has no key, so any Host is accepted.
    """

    def __init__(
        self,
        app,
        api_key: str | None,
        max_bytes: int,
        metrics_key: str | None = None,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None
        metrics_key = metrics_key or api_key
        self.expected_metrics = f"Bearer {metrics_key}".encode() if metrics_key else None
        self.max_bytes = max_bytes
        self.check_host = api_key is None and "*" not in allowed_hosts
        self.allowed_hosts = frozenset(h.lower().rstrip(".") for h in allowed_hosts)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or ())
        refusal = self._refusal(scope["path"], scope["method"], headers)
        if refusal is not None:
            return await refusal(scope, receive, send)
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        received = 0
        more_body = True

        async def limited_receive():
            nonlocal received, more_body
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                more_body = message.get("more_body", False)
                if received > self.max_bytes:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            # Read (and drop) the rest of a moderately oversized body first: a client still sending when the
            # answer comes sees a connection reset instead of the 413.
            budget = 8 * self.max_bytes
            while more_body and budget > 0:
                message = await receive()
                if message["type"] != "http.request":
                    break
                budget -= len(message.get("body", b""))
                more_body = message.get("more_body", False)
            await self._refuse(scope, receive, send)

    def _refusal(self, path: str, method: str, headers: dict[bytes, bytes]) -> JSONResponse | None:
        """The answer to a request refused before it reaches a route, or None."""
        if self.check_host:
            name = host_name(headers.get(b"host", b""))
            if not (is_loopback(name) or name in self.allowed_hosts):
                return error_response(
                    403,
                    f"the Host {name!r} is not allowed: without an API key this server answers only requests "
                    f"addressed to a loopback name (localhost, 127.x.x.x, [::1]); start it with --api-key, or "
                    f"name this host in --allowed-hosts",
                    "invalid_request_error",
                    None,
                    "host_not_allowed",
                )
        expected = self.expected_metrics if path == "/metrics" else self.expected if path.startswith("/v1") else None
        if expected is not None and not hmac.compare_digest(headers.get(b"authorization", b""), expected):
            return error_response(
                401,
                "missing or wrong API key; send 'Authorization: Bearer <key>'",
                "invalid_request_error",
                None,
                "invalid_api_key",
            )
        if method in ("POST", "PUT", "PATCH"):
            media_type = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media_type != b"application/json":
                return error_response(
                    415,
                    f"the request body must be sent with 'Content-Type: application/json', not "
                    f"{media_type.decode('latin-1') or 'none'!r}",
                    "invalid_request_error",
                    None,
                    "unsupported_media_type",
                )
        return None

    async def _refuse(self, scope, receive, send) -> None:
        response = error_response(
            413,
            f"the request body is larger than {self.max_bytes} bytes",
            "invalid_request_error",
            None,
            "request_too_large",
        )
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def host_name(host: bytes) -> str:
    """The name in a Host header, lower-cased, without port or trailing dot: 'localhost', '127.0.0.1', '::1'."""
    text = host.decode("latin-1").strip().lower()
    if text.startswith("["):  # [v6 address]:port
        text = text[1 : text.find("]")] if "]" in text else text[1:]
    elif text.count(":") == 1:
        text = text.split(":")[0]
    return text.rstrip(".")


def is_loopback(name: str) -> bool:
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback  # 127.0.0.0/8 and ::1
    except ValueError:
        return False
