"""Every request observed: an id (taken from `X-Request-ID` or made, and sent back), its
metrics, and one log line, once its answer starts (a pure ASGI middleware: the answer
passes through untouched, streamed ones included)."""

from __future__ import annotations

import logging
import time
import uuid

from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from r3store_server.logs import request_id
from r3store_server.metrics import Metrics

log = logging.getLogger("r3store.server")


class Observe:
    """The outermost middleware but the framework's own: `app.add_middleware(Observe)`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = (Headers(scope=scope).get("x-request-id") or uuid.uuid4().hex)[:64]
        token = request_id.set(rid)
        started = time.perf_counter()

        async def answer(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message).append("X-Request-ID", rid)
                _record(scope, message["status"], time.perf_counter() - started)
            await send(message)

        try:
            await self.app(scope, receive, answer)
        finally:
            request_id.reset(token)


def _record(scope: Scope, status: int, elapsed: float) -> None:
    """The request's metrics and its log line."""
    path = getattr(scope.get("route"), "path", "unmatched")
    metrics: Metrics = scope["app"].state.metrics
    metrics.requests.labels(path, scope["method"], status).inc()
    metrics.latency.labels(path).observe(elapsed)
    code = scope.get("state", {}).get("error_code")
    if code:
        metrics.errors.labels(code).inc()
    client = scope.get("client")
    fields = {
        "method": scope["method"],
        "path": scope["path"],
        "status": status,
        "ms": round(elapsed * 1000, 2),
        "client": f"{client[0]}:{client[1]}" if client else "-",
        **({"error": code} if code else {}),
    }
    log.info("request", extra={"fields": fields})
