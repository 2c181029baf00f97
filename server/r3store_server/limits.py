"""What a request may cost: memory for uploads in flight, and time.

`MemoryBudget` admits an upload only if its bytes fit: the body and the working memory
of validating and encoding it (`UPLOAD_COST` times the body, measured in
`bench/hardening_bench.py`). An upload waits for room a while, its body unread (the
client's sending pauses); then the answer is 429 `backpressure` with Retry-After. The
reservation lasts until the work on the upload ends, even when the client was answered
earlier; releasing a large one trims the heap, so the memory goes back to the system.
One API key's uploads hold at most `per_key` bytes of it at once, so a writer that
declares large bodies and sends them slowly (or never) cannot starve the others. Read
answers are charged to the same budget while they are sent (`answer_memory`).

`BodyGuard` checks the key of a request with a body before any of it is read (401,
connection closed), then bounds every body by route: the upload route (matched
exactly) reads its own, every other body (the JSON of the control plane, or a path
that does not exist) is capped at `JSON_BODY_BYTES`, declared or streamed. A path
open without a key takes no body (413 before any is read), but for the forms of /ui's
login and logout, of `OPEN_BODY_BYTES` at most. Every body
must keep arriving (`BodyClock`: a grace period plus a minimum rate), else 408
`request_timeout`. An answer sent before its request's body was read closes the
connection, so the rest of the body is not read either.

`Deadline` bounds a request: reading its body and the engine work it runs in a worker
thread. Past the deadline the client gets 503 `store_error` with Retry-After while the
thread finishes on its own (every store and catalog call has its own timeout, so it
does finish); work that had not started yet never starts.
"""

from __future__ import annotations

import ctypes
import functools
import threading
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread
import pyarrow
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from r3store.errors import (
    Backpressure,
    PayloadTooLarge,
    R3StoreError,
    RequestTimeout,
    StoreError,
    Unauthorized,
)
from r3store_server.auth import KeyRing
from r3store_server.errors import body as error_body
from r3store_server.errors import status_of

T = TypeVar("T")
JSON_BODY_BYTES = 4 << 20
ADMISSION_POLL = 0.05  # seconds between looks at the budget
TRIM_BYTES = 64 << 20  # releasing a reservation this large trims the heap


class Reservation:
    """Bytes held from a `MemoryBudget`. Work that uses them `claim`s them first; they
    go back once, by `release` (work done) or `abandon` (work never started)."""

    def __init__(self, budget: MemoryBudget, nbytes: int, key: str = "") -> None:
        self._budget = budget
        self.nbytes = nbytes
        self.key = key
        self._lock = threading.Lock()
        self._state = "held"  # -> "claimed" -> "released", or -> "released"

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more (a body of unknown length, as it arrives)."""
        self._budget.take(nbytes, self.key)
        self.nbytes += nbytes

    def claim(self) -> bool:
        """Called by the work when it begins: False if the reservation is gone."""
        with self._lock:
            if self._state != "held":
                return False
            self._state = "claimed"
            return True

    def release(self) -> None:
        with self._lock:
            if self._state == "released":
                return
            self._state = "released"
        self._budget.give(self.nbytes, self.key)
        if self.nbytes >= TRIM_BYTES:
            trim_heap()

    def abandon(self) -> None:
        """Release unless the work has claimed it (that work releases it when done)."""
        with self._lock:
            if self._state != "held":
                return
            self._state = "released"
        self._budget.give(self.nbytes, self.key)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim: Callable[[int], int] = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None
    return trim


def trim_heap() -> None:
    """Give free memory back to the operating system: Arrow's pool and glibc's heap keep
    the memory of a large upload's temporaries otherwise."""
    pyarrow.default_memory_pool().release_unused()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class MemoryBudget:
    """`MemoryBudget(768 << 20, per_key=384 << 20)`: at most `limit` bytes reserved at
    once, and at most `per_key` of them by one key (all of them when not given)."""

    def __init__(self, limit: int, per_key: int | None = None, retry_after: float = 1.0) -> None:
        self.limit = limit
        self.per_key = limit if per_key is None else per_key
        self.retry_after = retry_after
        self._used = 0
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def held(self, key: str) -> int:
        return self._held.get(key, 0)

    def take(self, nbytes: int, key: str = "") -> None:
        with self._lock:
            held = self._held.get(key, 0)
            if held + nbytes > self.per_key:
                raise Backpressure(
                    f"uploads and answers of key {key!r} in flight hold {held} of the "
                    f"{self.per_key} bytes one key may hold; this one needs {nbytes} more: "
                    "retry later",
                    retry_after=self.retry_after,
                )
            if self._used + nbytes > self.limit:
                raise Backpressure(
                    f"uploads and answers in flight hold {self._used} of {self.limit} bytes; "
                    f"this one needs {nbytes} more: retry later",
                    retry_after=self.retry_after,
                )
            self._used += nbytes
            self._held[key] = held + nbytes

    def give(self, nbytes: int, key: str = "") -> None:
        with self._lock:
            self._used -= nbytes
            left = self._held.get(key, 0) - nbytes
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)

    def reserve(self, nbytes: int, key: str = "") -> Reservation:
        self.take(nbytes, key)
        return Reservation(self, nbytes, key)

    async def admit(self, nbytes: int, wait: float, key: str = "") -> Reservation:
        """Reserve `nbytes` for `key`, waiting up to `wait` seconds for room (a waiting
        upload's body stays in the network, unread); then `Backpressure`."""
        end = anyio.current_time() + wait
        while True:
            try:
                return self.reserve(nbytes, key)
            except Backpressure:
                if anyio.current_time() >= end:
                    raise
            await anyio.sleep(ADMISSION_POLL)


class Deadline:
    """The time left to one request: `Deadline(30.0)` at its start."""

    def __init__(self, seconds: float, retry_after: float = 2.0) -> None:
        self.seconds = seconds
        self.retry_after = retry_after
        self._end = anyio.current_time() + seconds
        # set once the request is answered while work of `run` may still go on (past
        # the deadline, or cancelled): that work asks it between steps and stops
        self.cancelled = threading.Event()

    def _expired(self, what: str) -> StoreError:
        return StoreError(
            f"{what} did not finish within {self.seconds:g} s (the object store or the "
            "catalog is slow or unreachable); retry later",
            retry_after=self.retry_after,
        )

    async def wait(self, awaitable: Awaitable[T], what: str) -> T:
        """Await `awaitable` (reading a body, say) within the time left."""
        try:
            with anyio.fail_at(self._end):
                return await awaitable
        except TimeoutError:
            raise self._expired(what) from None

    async def run(
        self,
        fn: Callable[..., T],
        *args: object,
        what: str = "the request",
        reservation: Reservation | None = None,
    ) -> T:
        """`fn(*args)` in a worker thread, within the time left. A `reservation` is
        released when `fn` ends (or at once, if it never starts)."""

        def work() -> T:
            if reservation is None:
                return fn(*args)
            if not reservation.claim():
                raise self._expired(what)
            try:
                return fn(*args)
            finally:
                reservation.release()

        try:
            with anyio.fail_at(self._end):
                return await anyio.to_thread.run_sync(work, abandon_on_cancel=True)
        except TimeoutError:
            self.cancelled.set()
            raise self._expired(what) from None
        except anyio.get_cancelled_exc_class():  # the client went away, the server stops
            self.cancelled.set()
            raise
        finally:
            if reservation is not None:
                reservation.abandon()


class BodyClock:
    """The time a body may take to arrive: `grace` seconds, plus one second for every
    `rate` bytes received so far (counted from the first read). A body that falls
    further behind (sent slowly, or never) raises `RequestTimeout`."""

    def __init__(self, grace: float, rate: float) -> None:
        self.grace = grace
        self.rate = rate
        self.received = 0
        self._start: float | None = None

    async def receive(self, receive: Receive) -> Message:
        if self._start is None:
            self._start = anyio.current_time()
        try:
            with anyio.fail_at(self._start + self.grace + self.received / self.rate):
                message = await receive()
        except TimeoutError:
            raise RequestTimeout(
                f"the body did not arrive in time ({self.received} bytes in "
                f"{anyio.current_time() - self._start:.1f} s): a body may take "
                f"{self.grace:g} s plus one second per {self.rate:g} bytes"
            ) from None
        self.received += len(message.get("body", b""))
        return message


OPEN_PATHS = ("/healthz", "/readyz", "/openapi.json", "/docs", "/ui")  # /ui: its own login
# the only bodies sent without a key: the /ui forms (a key and a page, `ui._LOGIN_BYTES`)
OPEN_BODIES = frozenset({("POST", "/ui/login"), ("POST", "/ui/logout")})
OPEN_BODY_BYTES = 4096


def is_open(path: str) -> bool:
    """Whether `path` is answered without an API key in a header (docs/api.md)."""
    return any(path == p or path.startswith(p + "/") for p in OPEN_PATHS)


def presented_key(headers: list[tuple[bytes, bytes]]) -> str | None:
    """The key a request sends, read as `deps.get_principal` reads it: `X-API-Key`, else
    `Authorization: Bearer <key>`."""
    key = bearer = None
    for name, value in headers:
        if name == b"x-api-key" and key is None:
            key = value.decode("latin-1")
        elif name == b"authorization" and bearer is None:
            bearer = value.decode("latin-1")
    if key:
        return key
    scheme, _, token = (bearer or "").partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


@dataclass(frozen=True)
class BodyGuard:
    """ASGI middleware bounding request bodies (the module's docstring): `keyring`
    authenticates a request with a body before it is read (paths that need a key;
    the open ones take no body, but for `OPEN_BODIES` of `OPEN_BODY_BYTES`);
    `is_upload(method, path)` names the upload route, which reads (and limits) its own
    body; every other body may carry `limit` bytes; every body keeps to a `BodyClock`
    of `grace` seconds and `rate` bytes per second."""

    app: ASGIApp
    keyring: KeyRing
    is_upload: Callable[[str, str], bool]
    limit: int
    grace: float
    rate: float

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared, chunked = _declared_body(scope["headers"])
        if not chunked and not declared:  # no body: nothing to bound
            await self.app(scope, receive, send)
            return
        exchange = _Exchange(receive, send, BodyClock(self.grace, self.rate))
        limit = await self._limit(scope, exchange.send)
        if limit is None:
            return
        if self.is_upload(scope["method"], scope["path"]):
            await self.app(scope, exchange.receive, exchange.send)
            return
        if declared is not None and declared > limit:
            why = f"the body has {declared} bytes; the limit is {limit} bytes"
            await _refuse(413, PayloadTooLarge.code, why, scope, exchange.send)
            return
        replay = await exchange.whole(scope, limit)
        if replay is not None:
            await self.app(scope, replay, exchange.send)

    async def _limit(self, scope: Scope, send: Send) -> int | None:
        """The bytes the request's body may carry, its key checked first (a path open
        without a key takes none, but the login forms); None once refused: 401, or 429
        for an address past its failed keys."""
        if is_open(scope["path"]):  # no key to check: no body, but for the login form
            return OPEN_BODY_BYTES if (scope["method"], scope["path"]) in OPEN_BODIES else 0
        client = scope.get("client")
        try:
            await anyio.to_thread.run_sync(
                self.keyring.authenticate,
                presented_key(scope["headers"]),
                client[0] if client else None,
            )
        except R3StoreError as exc:
            await _refuse(status_of(exc), exc.code, str(exc), scope, send, _headers(exc))
            return None
        return self.limit


def _declared_body(headers: list[tuple[bytes, bytes]]) -> tuple[int | None, bool]:
    """What a request says of its body: its Content-Length (None: none, or not a
    number), and whether it is sent chunked."""
    declared, chunked = None, False
    for name, value in headers:
        if name == b"content-length" and declared is None:
            declared = int(value) if value.isdigit() else None
        elif name == b"transfer-encoding":
            chunked = True
    return declared, chunked


class _Exchange:
    """A request with a body as `BodyGuard` hands it on: the body received within its
    `BodyClock`, and the answer, which closes the connection when it starts before the
    whole body was read (the server would read, and drop, the rest otherwise)."""

    def __init__(self, receive: Receive, send: Send, clock: BodyClock) -> None:
        self._receive = receive
        self._send = send
        self._clock = clock
        self.read = False  # whether the whole body has been read

    async def receive(self) -> Message:
        message = await self._clock.receive(self._receive)
        if message["type"] != "http.request" or not message.get("more_body", False):
            self.read = True
        return message

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start" and not self.read:
            message = {**message, "headers": [*message.get("headers", []), CLOSE]}
        await self._send(message)

    async def whole(self, scope: Scope, limit: int) -> Receive | None:
        """The body read whole (small by now), to be handed on as one message; None
        once refused: past `limit` bytes (413), or arriving too slowly (408)."""
        chunks: list[bytes] = []
        size = 0
        try:
            while not self.read:
                message = await self.receive()
                if message["type"] != "http.request":
                    break
                size += len(message.get("body", b""))
                if size > limit:
                    why = f"the body exceeds the limit of {limit} bytes"
                    await _refuse(413, PayloadTooLarge.code, why, scope, self.send)
                    return None
                chunks.append(message.get("body", b""))
        except RequestTimeout as exc:
            await _refuse(408, exc.code, str(exc), scope, self.send)
            return None
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal whole
            if whole is None:
                return await self._receive()
            message, whole = whole, None
            return message

        return replay


CLOSE = (b"connection", b"close")


def _headers(exc: R3StoreError) -> dict[str, str]:
    """The headers of a refusal: how to authenticate, when to retry."""
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, Unauthorized) else {}
    retry = getattr(exc, "retry_after", None)
    if isinstance(retry, int | float):
        headers["Retry-After"] = str(max(1, round(retry)))
    return headers


async def _refuse(
    status: int,
    code: str,
    message: str,
    scope: Scope,
    send: Send,
    headers: dict[str, str] | None = None,
) -> None:
    scope.setdefault("state", {})["error_code"] = code  # for the request's metrics
    answer = JSONResponse(error_body(code, message), status_code=status, headers=headers)

    async def nothing() -> Message:
        return {"type": "http.disconnect"}

    await answer(scope, nothing, send)
