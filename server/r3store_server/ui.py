"""The status page at /ui: namespaces, expert-load heatmaps per policy version,
agreement between route sources, drift, retention and compaction activity.

Server-side HTML and SVG (`ui_render`), no script and no asset from elsewhere. Same
keys as the API, with the `read` right: sent as a header, or typed once into the login
form, which keeps the key in an HttpOnly, SameSite=Strict cookie scoped to /ui (the API
never reads that cookie).
"""

from __future__ import annotations

import dataclasses
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Path, Request, Security
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials

from r3store import __version__
from r3store.errors import Forbidden, Unauthorized
from r3store.models import NAME_PATTERN
from r3store.policy import SOURCES
from r3store_server.auth import Principal
from r3store_server.deps import API_KEY, BEARER, DeadlineDep, EngineDep, KeyRingDep
from r3store_server.ui_render import (
    Activity,
    NamespaceDetail,
    NamespaceRow,
    login_page,
    namespace_page,
    overview,
)

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "r3store_key"
LAST_VERSIONS = 6  # heatmaps shown per source
_LOGIN_BYTES = 4096


def _presented(
    request: Request,
    key: str | None,
    bearer: HTTPAuthorizationCredentials | None,
) -> str | None:
    if key is not None:
        return key
    if bearer is not None:
        return bearer.credentials
    return request.cookies.get(COOKIE)


def _who(request: Request, keys: KeyRingDep, key: str | None, bearer: object) -> Principal:
    creds = bearer if isinstance(bearer, HTTPAuthorizationCredentials) else None
    return keys.authenticate(_presented(request, key, creds))


KeyHeader = Annotated[str | None, Security(API_KEY)]
BearerHeader = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


def _refused(exc: Unauthorized | Forbidden) -> HTMLResponse:
    status = 401 if isinstance(exc, Unauthorized) else 403
    return HTMLResponse(login_page(str(exc)), status_code=status)


@router.get("", response_class=HTMLResponse)
async def front(
    request: Request,
    engine: EngineDep,
    keys: KeyRingDep,
    deadline: DeadlineDep,
    key: KeyHeader = None,
    bearer: BearerHeader = None,
) -> HTMLResponse:
    try:
        who = _who(request, keys, key, bearer)
        keys.authorize(who, "read")
    except (Unauthorized, Forbidden) as exc:
        return _refused(exc)

    def gather() -> list[NamespaceRow]:
        return [
            NamespaceRow(info, engine.usage(info.name))
            for info in engine.list_namespaces()
            if who.may("read", info.name)
        ]

    rows = await deadline.run(gather, what="the status page")
    maintenance = getattr(request.app.state, "maintenance", None)
    activity = None
    if maintenance is not None:
        activity = Activity(dataclasses.asdict(maintenance.totals))
    return HTMLResponse(overview(rows, activity, __version__))


@router.get("/namespaces/{namespace}", response_class=HTMLResponse)
async def namespace(
    request: Request,
    engine: EngineDep,
    keys: KeyRingDep,
    deadline: DeadlineDep,
    key: KeyHeader = None,
    bearer: BearerHeader = None,
    namespace: str = Path(pattern=NAME_PATTERN),
) -> HTMLResponse:
    try:
        keys.authorize(_who(request, keys, key, bearer), "read", namespace)
    except (Unauthorized, Forbidden) as exc:
        return _refused(exc)

    def gather() -> NamespaceDetail:
        info = engine.namespace(namespace)
        analytics = engine.analytics
        pairs = [(a, b) for i, a in enumerate(SOURCES) for b in SOURCES[i + 1 :]]
        return NamespaceDetail(
            NamespaceRow(info, engine.usage(namespace)),
            {source: analytics.loads(namespace, source) for source in SOURCES},
            {pair: analytics.agreement(namespace, *pair) for pair in pairs},
            analytics.drift(namespace),
        )

    detail = await deadline.run(gather, what="the status page")
    return HTMLResponse(namespace_page(detail, LAST_VERSIONS))


@router.post("/login")
async def login(request: Request, keys: KeyRingDep) -> Response:
    """Check the key typed into the form, keep it in a cookie for /ui, go to /ui."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _LOGIN_BYTES:
            return HTMLResponse(login_page("the form is too large"), status_code=413)
    values = parse_qs(body.decode("utf-8", "replace"))
    presented = (values.get("key") or [""])[0].strip()
    try:
        keys.authorize(keys.authenticate(presented or None), "read")
    except (Unauthorized, Forbidden) as exc:
        return _refused(exc)
    response = RedirectResponse("/ui", status_code=303)
    response.set_cookie(
        COOKIE, presented, httponly=True, samesite="strict", path="/ui", max_age=8 * 3600
    )
    return response
