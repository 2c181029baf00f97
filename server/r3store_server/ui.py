"""The status page at /ui: namespaces, agreement between route sources and drift over
policy versions, load imbalance per layer, expert-load heatmaps per policy version,
retention and compaction activity.

Server-side HTML and SVG (`ui_render`), no script and no asset from elsewhere. Same
keys as the API, with the `read` right: sent as a header, or typed once into the login
form, which keeps the key in an HttpOnly, SameSite=Strict cookie scoped to /ui (the API
never reads that cookie).
"""

from __future__ import annotations

import dataclasses
import gzip as gzip_module
import re
from typing import Annotated
from urllib.parse import parse_qs

from fastapi import APIRouter, Path, Request, Security
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials

from r3store import __version__
from r3store.analytics import VersionLoad
from r3store.errors import Forbidden, NotFound, Unauthorized
from r3store.models import NAME_PATTERN
from r3store.policy import SOURCES
from r3store_server.auth import Principal
from r3store_server.deps import API_KEY, BEARER, DeadlineDep, EngineDep, KeyRingDep
from r3store_server.ui_render import (
    Activity,
    NamespaceDetail,
    NamespaceRow,
    login_page,
    message_page,
    namespace_page,
    overview,
)

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "r3store_key"
LAST_VERSIONS = 6  # heatmaps shown per source
_LOGIN_BYTES = 4096
_GZIP_FROM = 16384  # characters of a page worth compressing


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


_THEN = re.compile(r"/ui(/namespaces/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")


def _refused(
    exc: Unauthorized | Forbidden, presented: str | None, then: str = "/ui"
) -> HTMLResponse:
    """The login form, saying why in words for a browser (not the API's header advice);
    a key the server does not know is taken out of the cookie."""
    if isinstance(exc, Forbidden):
        message = f"This key may not open this page: {exc}. Sign in with another key."
        status = 403
    elif presented:
        message = "The server does not know this API key (mistyped, or revoked). Try another."
        status = 401
    else:
        message = "Sign in with an API key that has the read right."
        status = 401
    response = HTMLResponse(login_page(message, then), status_code=status)
    if presented and isinstance(exc, Unauthorized):
        response.delete_cookie(COOKIE, path="/ui", httponly=True, samesite="strict")
    return response


def _takes_gzip(request: Request) -> bool:
    for part in request.headers.get("accept-encoding", "").split(","):
        name, _, params = part.strip().partition(";")
        if name.strip().lower() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def _encoded(page: str, gzip: bool) -> bytes | str:
    """The page, gzip-compressed when the browser takes it and it is worth it."""
    if not gzip or len(page) < _GZIP_FROM:
        return page
    return gzip_module.compress(page.encode(), compresslevel=5)


def _html(page: bytes | str) -> HTMLResponse:
    if isinstance(page, str):
        return HTMLResponse(page, headers={"Vary": "Accept-Encoding"})
    return HTMLResponse(page, headers={"Content-Encoding": "gzip", "Vary": "Accept-Encoding"})


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
        return _refused(exc, _presented(request, key, bearer))

    def gather() -> list[NamespaceRow]:
        return [
            NamespaceRow(info, engine.usage(info.name))
            for info in engine.list_namespaces()
            if who.may("read", info.name)
        ]

    maintenance = getattr(request.app.state, "maintenance", None)
    activity = None
    if maintenance is not None:
        activity = Activity(dataclasses.asdict(maintenance.totals))
    gzip = _takes_gzip(request)

    def page() -> bytes | str:
        return _encoded(overview(gather(), activity, __version__), gzip)

    return _html(await deadline.run(page, what="the status page"))


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
        return _refused(exc, _presented(request, key, bearer), f"/ui/namespaces/{namespace}")

    def gather() -> NamespaceDetail:
        info = engine.namespace(namespace)
        analytics = engine.analytics
        pairs = [(a, b) for i, a in enumerate(SOURCES) for b in SOURCES[i + 1 :]]
        loads: dict[str, list[VersionLoad]] = {
            source: analytics.loads(namespace, source) for source in SOURCES
        }
        return NamespaceDetail(
            NamespaceRow(info, engine.usage(namespace)),
            loads,
            {pair: analytics.agreement(namespace, *pair) for pair in pairs},
            {
                source: analytics.drift(namespace, source)
                for source in SOURCES
                if len(loads[source]) > 1
            },
        )

    gzip = _takes_gzip(request)

    def page() -> bytes | str:  # a large model's heatmaps make megabytes of SVG
        return _encoded(namespace_page(gather(), LAST_VERSIONS), gzip)

    try:
        return _html(await deadline.run(page, what="the status page"))
    except NotFound:
        return HTMLResponse(
            message_page(f"There is no namespace named {namespace}."), status_code=404
        )


@router.post("/login")
async def login(request: Request, keys: KeyRingDep) -> Response:
    """Check the key typed into the form, keep it in a cookie for /ui, go back to the
    page asked for (one of /ui)."""
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > _LOGIN_BYTES:
            return HTMLResponse(login_page("the form is too large"), status_code=413)
    values = parse_qs(body.decode("utf-8", "replace"))
    presented = (values.get("key") or [""])[0].strip()
    then = (values.get("then") or ["/ui"])[0]
    if not _THEN.fullmatch(then):  # only pages of /ui: never another site
        then = "/ui"
    try:
        keys.authorize(keys.authenticate(presented or None), "read")
    except (Unauthorized, Forbidden) as exc:
        return _refused(exc, presented or None, then)
    response = RedirectResponse(then, status_code=303)
    response.set_cookie(
        COOKIE, presented, httponly=True, samesite="strict", path="/ui", max_age=8 * 3600
    )
    return response
