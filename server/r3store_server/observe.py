"""Every request observed: an id (taken from `X-Request-ID` or made, and sent back), its
metrics, and one log line."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable

from fastapi import Request, Response

from r3store_server.logs import request_id
from r3store_server.metrics import Metrics

log = logging.getLogger("r3store.server")


async def observe(
    request: Request, call_next: Callable[[Request], Awaitable[Response]]
) -> Response:
    rid = (request.headers.get("x-request-id") or uuid.uuid4().hex)[:64]
    token = request_id.set(rid)
    started = time.perf_counter()
    try:
        response = await call_next(request)
        elapsed = time.perf_counter() - started
        path = getattr(request.scope.get("route"), "path", "unmatched")
        metrics: Metrics = request.app.state.metrics
        metrics.requests.labels(path, request.method, response.status_code).inc()
        metrics.latency.labels(path).observe(elapsed)
        code = getattr(request.state, "error_code", None)
        if code:
            metrics.errors.labels(code).inc()
        response.headers["X-Request-ID"] = rid
        fields = {
            "method": request.method,
            "path": request.url.path,
            "status": response.status_code,
            "ms": round(elapsed * 1000, 2),
            "client": f"{request.client.host}:{request.client.port}" if request.client else "-",
            **({"error": code} if code else {}),
        }
        log.info("request", extra={"fields": fields})
        return response
    finally:
        request_id.reset(token)
