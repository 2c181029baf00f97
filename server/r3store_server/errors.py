"""Errors to HTTP, in one place: the project's exceptions become a status and a body
`{"error": {"code": ..., "message": ...}}`; nothing else reaches a client."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from r3store import errors
from r3store.protocol.models import ErrorBody

log = logging.getLogger("r3store.server")

STATUS: list[tuple[type[errors.R3StoreError], int]] = [
    (errors.PayloadTooLarge, 413),
    (errors.UnsupportedMediaType, 415),
    (errors.Unauthorized, 401),
    (errors.Forbidden, 403),
    (errors.TooManyFailures, 429),
    (errors.InvalidInput, 400),
    (errors.NotFound, 404),
    (errors.StalePolicy, 409),
    (errors.Conflict, 409),
    (errors.Backpressure, 429),
    (errors.RequestTimeout, 408),
    (errors.HeadersTooLarge, 431),
    (errors.StoreError, 503),
    (errors.CorruptShard, 500),
]


def status_of(exc: errors.R3StoreError) -> int:
    for kind, status in STATUS:
        if isinstance(exc, kind):
            return status
    return 500


def body(code: str, message: str) -> dict[str, dict[str, str]]:
    return {"error": {"code": code, "message": message}}


def install(app: FastAPI) -> None:
    @app.exception_handler(errors.R3StoreError)
    async def known(request: Request, exc: errors.R3StoreError) -> JSONResponse:
        status = status_of(exc)
        request.state.error_code = exc.code
        headers = {}
        if isinstance(exc, errors.Backpressure | errors.StoreError | errors.TooManyFailures):
            headers["Retry-After"] = str(max(1, round(exc.retry_after)))
        if status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        if status >= 500:
            log.error("request failed: %s", exc)
        return JSONResponse(body(exc.code, str(exc)), status_code=status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        request.state.error_code = "invalid_request"
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()[:5]
        )
        return JSONResponse(body("invalid_request", problems), status_code=422)

    @app.exception_handler(StarletteHTTPException)
    async def http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large"}.get(
            exc.status_code, "http_error"
        )
        request.state.error_code = code
        return JSONResponse(body(code, str(exc.detail)), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        request.state.error_code = "internal"
        log.exception("unexpected error")
        return JSONResponse(body("internal", "internal error; see the server log"), 500)


_ERROR = {"model": ErrorBody, "description": "an error: see `error.code`"}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {**_ERROR, "description": text}
    for status, text in (
        (400, "bad input: nothing was changed"),
        (401, "no or unknown API key"),
        (403, "the key may not do this"),
        (404, "no such namespace"),
        (409, "conflict: other content under the same id, an existing name, or stale routes"),
        (422, "the request does not match its schema"),
        (429, "too many unknown keys from this address, or busy: retry after Retry-After"),
        (503, "the object store or catalog is unavailable"),
    )
}
