"""The status page at /ui: namespaces, agreement between route sources and drift over
policy versions, load imbalance per layer, expert-load heatmaps per policy version,
retention and compaction activity, a trainer's step checkpoints and open leases.

Server-side HTML and SVG (`ui_render`), no script and no asset from elsewhere. Same
keys as the API, with the `read` right: sent as a header, or typed once into the login
form. The form makes a session: the key's SHA-256 and an expiry, signed with HMAC-SHA256
(`R3STORE_UI_SECRET`, or a secret made at start), in an HttpOnly, SameSite=Strict cookie
scoped to /ui (Secure when the page is served over https; the API never reads it). The
key is checked again on every page, so a revoked key's session ends with it. Sign-in and
sign-out are refused unless the browser says they come from this server's own page
(`Origin`, else `Sec-Fetch-Site` or `Referer`): another site cannot sign a browser in
with its key.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import gzip as gzip_module
import hashlib
import hmac
import re
import secrets
import threading
import time
from collections.abc import Callable
from typing import Annotated
from urllib.parse import parse_qs, urlsplit

from fastapi import APIRouter, Depends, Path, Request, Security
from fastapi.responses import HTMLResponse, RedirectResponse, Response
from fastapi.security import HTTPAuthorizationCredentials

from r3store import __version__
from r3store.engine.analytics import VersionLoad
from r3store.errors import Forbidden, NotFound, TooManyFailures, Unauthorized
from r3store.policy import SOURCES
from r3store.protocol.models import NAME_PATTERN
from r3store_server.auth import Principal, digest
from r3store_server.deps import (
    API_KEY,
    BEARER,
    DeadlineDep,
    EngineDep,
    KeyRingDep,
    client_address,
)
from r3store_server.ui_render import (
    Activity,
    Consumption,
    NamespaceDetail,
    NamespaceRow,
    login_page,
    message_page,
    namespace_page,
    overview,
)

router = APIRouter(prefix="/ui", include_in_schema=False)
COOKIE = "r3store_session"
OLD_COOKIE = "r3store_key"  # earlier versions kept the key itself there: taken away
SESSION_SECONDS = 8 * 3600
LAST_VERSIONS = 6  # heatmaps shown per source
_LOGIN_BYTES = 4096
_GZIP_FROM = 16384  # characters of a page worth compressing
_SESSION = b"r3store-ui-session\x00"  # what the MAC signs: this, then the payload
_TOKEN_VERSION = 1
_ENDED = "the session ended: sign in again"
_made_secret = threading.Lock()


def _secret(request: Request) -> bytes:
    """`R3STORE_UI_SECRET`, or one made at the first sign-in (until a restart)."""
    configured = request.app.state.settings.ui_secret
    if configured is not None:
        return str(configured.get_secret_value()).encode()
    with _made_secret:
        made: bytes | None = getattr(request.app.state, "ui_secret", None)
        if made is None:
            made = request.app.state.ui_secret = secrets.token_bytes(32)
    return made


def session_token(secret: bytes, key_digest: bytes, expires: int) -> str:
    """A session: the key's SHA-256 until `expires` (seconds since the epoch), signed."""
    payload = bytes([_TOKEN_VERSION]) + expires.to_bytes(8, "big") + key_digest
    mac = hmac.new(secret, _SESSION + payload, hashlib.sha256).digest()
    return base64.urlsafe_b64encode(payload + mac).decode().rstrip("=")


def session_digest(secret: bytes, token: str, now: float) -> bytes | None:
    """The key digest of a session signed with `secret` and not expired at `now`."""
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4))
    except (ValueError, binascii.Error):
        return None
    if len(raw) != 1 + 8 + 32 + 32 or raw[0] != _TOKEN_VERSION:
        return None
    payload, mac = raw[:41], raw[41:]
    expected = hmac.new(secret, _SESSION + payload, hashlib.sha256).digest()
    if not hmac.compare_digest(mac, expected) or int.from_bytes(payload[1:9], "big") <= now:
        return None
    return payload[9:]


def _who(request: Request, keys: KeyRingDep, key: str | None, bearer: object) -> Principal:
    """The key sent as a header, else the session's."""
    client = client_address(request)
    creds = bearer if isinstance(bearer, HTTPAuthorizationCredentials) else None
    presented = key if key is not None else creds.credentials if creds is not None else None
    token = request.cookies.get(COOKIE)
    if presented is not None or token is None:
        return keys.authenticate(presented, client)
    found = session_digest(_secret(request), token, time.time())
    if found is None:
        if not keys.enabled:
            return keys.authenticate(None, client)
        raise Unauthorized(_ENDED)
    return keys.authenticate_digest(found, client)


def _sent_something(request: Request, key: str | None, bearer: object) -> bool:
    return key is not None or bearer is not None or COOKIE in request.cookies


def _secure(request: Request) -> bool:
    """Served over TLS: https, as uvicorn sees it (X-Forwarded-Proto from a proxy it
    trusts, `FORWARDED_ALLOW_IPS`)."""
    return request.url.scheme == "https"


def _same_origin(request: Request) -> bool:
    """Whether a form post comes from a page of this server, as the browser says:
    `Origin`, else `Sec-Fetch-Site`, else `Referer`. A request with none of them is
    not a browser's (every browser sends one of them with a cross-site form post)."""
    hosts = {request.headers.get(name, "").lower() for name in ("host", "x-forwarded-host")} - {""}
    origin = request.headers.get("origin")
    if origin is not None:
        return origin != "null" and urlsplit(origin).netloc.lower() in hosts
    site = request.headers.get("sec-fetch-site")
    if site is not None:
        return site in ("same-origin", "none")
    referer = request.headers.get("referer")
    if referer is not None:
        return urlsplit(referer).netloc.lower() in hosts
    return True


def _cross_site() -> HTMLResponse:
    return HTMLResponse(
        message_page(
            "Refused: this form was not sent from this server's own page (another site "
            "cannot sign you in or out)."
        ),
        status_code=403,
    )


def _too_many(exc: TooManyFailures) -> HTMLResponse:
    wait = str(max(1, round(exc.retry_after)))
    return HTMLResponse(login_page(f"{exc}."), status_code=429, headers={"Retry-After": wait})


def _forget(
    response: Response, request: Request, names: tuple[str, ...] = (COOKIE, OLD_COOKIE)
) -> None:
    """Take the session's cookie (and an earlier version's key cookie) away."""
    for name in names:
        if name in request.cookies:
            response.delete_cookie(
                name, path="/ui", httponly=True, samesite="strict", secure=_secure(request)
            )


KeyHeader = Annotated[str | None, Security(API_KEY)]
BearerHeader = Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)]


_THEN = re.compile(r"/ui(/namespaces/[A-Za-z0-9][A-Za-z0-9._-]{0,127})?")


def _refused(
    exc: Unauthorized | Forbidden | TooManyFailures,
    request: Request,
    presented: bool,
    then: str = "/ui",
) -> HTMLResponse:
    """The login form, saying why in words for a browser (not the API's header advice);
    a session the server does not take any more loses its cookie."""
    if isinstance(exc, TooManyFailures):
        return _too_many(exc)
    if isinstance(exc, Forbidden):
        message = f"This key may not open this page: {exc}. Sign in with another key."
        status = 403
    elif str(exc) == _ENDED:
        message = "The session ended (it expired, or the server restarted). Sign in again."
        status = 401
    elif presented:
        message = "The server does not know this API key (mistyped, or revoked). Try another."
        status = 401
    else:
        message = "Sign in with an API key that has the read right."
        status = 401
    response = HTMLResponse(login_page(message, then), status_code=status)
    if isinstance(exc, Unauthorized):
        _forget(response, request)
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


@dataclasses.dataclass(frozen=True)
class Visit:
    """A browser's request for a page: what it sent, and what serving the page takes
    (a dependency: FastAPI fills in each field)."""

    request: Request
    engine: EngineDep
    keys: KeyRingDep
    deadline: DeadlineDep
    key: KeyHeader = None
    bearer: BearerHeader = None

    def reader(self, namespace: str | None = None) -> Principal | HTMLResponse:
        """Who sends it, with the read right (on `namespace`, if given); else the login
        form saying why, which goes back to the page asked for."""
        try:
            who = _who(self.request, self.keys, self.key, self.bearer)
            self.keys.authorize(who, "read", namespace)
        except (Unauthorized, Forbidden, TooManyFailures) as exc:
            then = "/ui" if namespace is None else f"/ui/namespaces/{namespace}"
            sent = _sent_something(self.request, self.key, self.bearer)
            return _refused(exc, self.request, sent, then)
        return who

    async def answer(self, render: Callable[[], str]) -> HTMLResponse:
        """The page `render` makes, off the event loop within the request's deadline."""
        gzip = _takes_gzip(self.request)

        def page() -> bytes | str:  # a large model's heatmaps make megabytes of SVG
            return _encoded(render(), gzip)

        return _html(await self.deadline.run(page, what="the status page"))


VisitDep = Annotated[Visit, Depends()]


@router.get("", response_class=HTMLResponse)
async def front(visit: VisitDep) -> HTMLResponse:
    who = visit.reader()
    if isinstance(who, HTMLResponse):
        return who
    engine = visit.engine

    def gather() -> list[NamespaceRow]:
        return [
            NamespaceRow(info, engine.namespaces.usage(info.name))
            for info in engine.namespaces.all()
            if who.may("read", info.name)
        ]

    maintenance = getattr(visit.request.app.state, "maintenance", None)
    activity = None
    if maintenance is not None:
        activity = Activity(dataclasses.asdict(maintenance.totals))
    return await visit.answer(lambda: overview(gather(), activity, __version__))


@router.get("/namespaces/{namespace}", response_class=HTMLResponse)
async def namespace(visit: VisitDep, namespace: str = Path(pattern=NAME_PATTERN)) -> HTMLResponse:
    who = visit.reader(namespace)
    if isinstance(who, HTMLResponse):
        return who
    engine = visit.engine

    def gather() -> NamespaceDetail:
        info = engine.namespaces.get(namespace)
        analytics = engine.analytics
        pairs = [(a, b) for i, a in enumerate(SOURCES) for b in SOURCES[i + 1 :]]
        loads: dict[str, list[VersionLoad]] = {
            source: analytics.loads(namespace, source) for source in SOURCES
        }
        return NamespaceDetail(
            NamespaceRow(info, engine.namespaces.usage(namespace)),
            loads,
            {pair: analytics.agreement(namespace, *pair) for pair in pairs},
            {
                source: analytics.drift(namespace, source)
                for source in SOURCES
                if len(loads[source]) > 1
            },
            Consumption(
                engine.consumption.epoch(namespace),
                engine.consumption.checkpoints(namespace),
                engine.consumption.open_leases(namespace),
                engine.clock(),
            ),
        )

    try:
        return await visit.answer(lambda: namespace_page(gather(), LAST_VERSIONS))
    except NotFound:
        return HTMLResponse(
            message_page(f"There is no namespace named {namespace}."), status_code=404
        )


@router.post("/login")
async def login(request: Request, keys: KeyRingDep) -> Response:
    """Check the key typed into the form (sent from this server's own page), keep a
    signed session for it in a cookie for /ui, go back to the page asked for (one of
    /ui)."""
    if not _same_origin(request):
        return _cross_site()
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
        keys.authorize(keys.authenticate(presented or None, client_address(request)), "read")
    except (Unauthorized, Forbidden, TooManyFailures) as exc:
        return _refused(exc, request, bool(presented), then)
    response = RedirectResponse(then, status_code=303)
    _forget(response, request, (OLD_COOKIE,))
    token = session_token(_secret(request), digest(presented), int(time.time()) + SESSION_SECONDS)
    response.set_cookie(
        COOKIE,
        token,
        httponly=True,
        samesite="strict",
        path="/ui",
        max_age=SESSION_SECONDS,
        secure=_secure(request),
    )
    return response


@router.post("/logout")
async def logout(request: Request) -> Response:
    """Forget the session's cookie (a post from this server's own page) and go to /ui."""
    if not _same_origin(request):
        return _cross_site()
    response = RedirectResponse("/ui", status_code=303)
    _forget(response, request)
    return response
