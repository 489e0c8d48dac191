"""One log line and the HTTP metrics for every API request, whatever its outcome.

A pure ASGI middleware (streams pass through untouched): it starts a record the routes
fill in (identity, tokens, cached tokens, stop reason), times the request to its last
byte and logs `http METHOD PATH STATUS ms ...` at INFO (/health at DEBUG, as probes would
flood the log). Identities appear only as short hashes; no body is ever logged. It also
bounds request bodies (413 before the bytes arrive in full).
"""

from __future__ import annotations

import json
import logging
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from inference_engine import metrics
from inference_engine.errors import RequestTooLarge
from inference_engine.server.openai_api.errors_http import error_of
from inference_engine.short_id import short_id

log = logging.getLogger("inference_engine.http")
MAX_BODY_BYTES = 8 << 20  # bytes of one request body (a full 8192-token prompt as JSON is far below)
ROUTES = ("/health", "/v1/models", "/v1/chat/completions", "/v1/completions", "/docs", "/openapi.json")
MODEL_ROUTE = "/v1/models/{id}"  # one label for every id asked for (metrics stay few)
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class HttpRecord:
    """Facts about one request (filled by the routes while it runs)."""

    identity: str = ""  # only ever logged through short_id
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    stop_reason: str = ""


_CURRENT: ContextVar[HttpRecord | None] = ContextVar("http_record", default=None)


def current() -> HttpRecord:
    """The current request's record (a throwaway outside an observed request)."""
    return _CURRENT.get() or HttpRecord()


def _line(method: str, path: str, status: int, ms: float, r: HttpRecord) -> str:
    fields = {"peer": short_id(r.identity) if r.identity else None, "tokens_in": r.prompt_tokens,
              "tokens_out": r.completion_tokens, "cached": r.cached_tokens, "stop_reason": r.stop_reason or None}
    extra = " ".join(f"{k}={v}" for k, v in fields.items() if v is not None)
    return f"http {method} {path} {status} {ms:.1f} ms {extra}".rstrip()


class RequestObserver:
    """ASGI middleware: body bound, timing, metrics and the log line."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_body_bytes: int = MAX_BODY_BYTES):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        record = HttpRecord()
        _CURRENT.set(record)
        start = time.perf_counter()
        status = 500
        path = scope.get("path", "")
        route = path if path in ROUTES else MODEL_ROUTE if path.startswith("/v1/models/") else "other"

        is_started = False

        async def observed_send(message: dict[str, Any]) -> None:
            nonlocal status, is_started
            if message["type"] == "http.response.start":
                status, is_started = message["status"], True
            await send(message)

        received = 0

        async def bounded_receive() -> dict[str, Any]:
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            if received > self.max_body_bytes:
                raise RequestTooLarge(self._too_large(received))
            return message

        try:
            length = dict(scope.get("headers", ())).get(b"content-length", b"0")
            if length.isdigit() and int(length) > self.max_body_bytes:
                await self._refuse(RequestTooLarge(self._too_large(int(length))), observed_send)
                return
            try:
                await self.app(scope, bounded_receive, observed_send)
            except Exception as exc:  # noqa: BLE001 - unexpected: answered 500 here, logged once (error_of)
                if is_started:
                    log.error("unexpected error after the response started", exc_info=exc)
                    return
                await self._refuse(exc, observed_send)
        finally:
            seconds = time.perf_counter() - start
            metrics.HTTP_REQUESTS.labels(route, str(status)).inc()
            metrics.HTTP_SECONDS.labels(route).observe(seconds)
            level = logging.DEBUG if route == "/health" else logging.INFO
            log.log(level, _line(scope.get("method", ""), route if route != "other" else "(other)", status,
                                 seconds * 1e3, record))

    def _too_large(self, n: int) -> str:
        return f"the request body has {n} bytes or more; this server accepts at most {self.max_body_bytes}"

    @staticmethod
    async def _refuse(exc: Exception, send: Send) -> None:
        status, body, headers = error_of(exc)
        data = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode()),
                                (b"connection", b"close"), *((k.lower().encode(), v.encode()) for k, v in headers.items())]})
        await send({"type": "http.response.body", "body": data})
