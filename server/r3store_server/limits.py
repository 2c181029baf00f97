"""What a request may cost: memory for uploads in flight, and time.

`MemoryBudget` admits an upload only if its bytes fit: the body and the working memory
of validating and encoding it (`UPLOAD_COST` times the body, measured in
`bench/hardening_bench.py`). An upload waits for room a while, its body unread (the
client's sending pauses); then the answer is 429 `backpressure` with Retry-After. The
reservation lasts until the work on the upload ends, even when the client was answered
earlier; releasing a large one trims the heap, so the memory goes back to the system.

`JsonBodyLimit` caps every other body (the JSON of the control plane) at
`JSON_BODY_BYTES`, declared or streamed.

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
from typing import TypeVar

import anyio
import anyio.to_thread
import pyarrow
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from r3store.errors import Backpressure, PayloadTooLarge, StoreError
from r3store_server.errors import body as error_body

T = TypeVar("T")
JSON_BODY_BYTES = 4 << 20
ADMISSION_POLL = 0.05  # seconds between looks at the budget
TRIM_BYTES = 64 << 20  # releasing a reservation this large trims the heap


class Reservation:
    """Bytes held from a `MemoryBudget`. Work that uses them `claim`s them first; they
    go back once, by `release` (work done) or `abandon` (work never started)."""

    def __init__(self, budget: MemoryBudget, nbytes: int) -> None:
        self._budget = budget
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._state = "held"  # -> "claimed" -> "released", or -> "released"

    def grow(self, nbytes: int) -> None:
        """Hold `nbytes` more (a body of unknown length, as it arrives)."""
        self._budget.take(nbytes)
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
        self._budget.give(self.nbytes)
        if self.nbytes >= TRIM_BYTES:
            trim_heap()

    def abandon(self) -> None:
        """Release unless the work has claimed it (that work releases it when done)."""
        with self._lock:
            if self._state != "held":
                return
            self._state = "released"
        self._budget.give(self.nbytes)


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
    """`MemoryBudget(768 << 20)`: at most that many bytes reserved at once."""

    def __init__(self, limit: int, retry_after: float = 1.0) -> None:
        self.limit = limit
        self.retry_after = retry_after
        self._used = 0
        self._lock = threading.Lock()

    @property
    def used(self) -> int:
        return self._used

    def take(self, nbytes: int) -> None:
        with self._lock:
            if self._used + nbytes > self.limit:
                raise Backpressure(
                    f"uploads in flight hold {self._used} of {self.limit} bytes; this one "
                    f"needs {nbytes} more: retry later",
                    retry_after=self.retry_after,
                )
            self._used += nbytes

    def give(self, nbytes: int) -> None:
        with self._lock:
            self._used -= nbytes

    def reserve(self, nbytes: int) -> Reservation:
        self.take(nbytes)
        return Reservation(self, nbytes)

    async def admit(self, nbytes: int, wait: float) -> Reservation:
        """Reserve `nbytes`, waiting up to `wait` seconds for room (a waiting upload's
        body stays in the network, unread); then `Backpressure`."""
        end = anyio.current_time() + wait
        while True:
            try:
                return self.reserve(nbytes)
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


class JsonBodyLimit:
    """ASGI middleware: requests other than uploads (`is_upload(path)`) may carry at
    most `limit` bytes; past it, 413 `payload_too_large` (uploads check their own)."""

    def __init__(self, app: ASGIApp, is_upload: Callable[[str], bool], limit: int) -> None:
        self.app = app
        self.is_upload = is_upload
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.is_upload(scope["path"]):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(f"the body has {int(declared)} bytes", scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:  # small by now: read it whole, then hand it on
            message = await receive()
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.limit:
                await self._refuse("the body exceeds it", scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        whole: Message | None = {"type": "http.request", "body": b"".join(chunks)}

        async def replay() -> Message:
            nonlocal whole
            if whole is None:
                return await receive()
            message, whole = whole, None
            return message

        await self.app(scope, replay, send)

    async def _refuse(self, what: str, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"{what}; the limit is {self.limit} bytes"
        answer = JSONResponse(error_body(PayloadTooLarge.code, message), status_code=413)
        await answer(scope, receive, send)
