"""The requests every client call sends, retried, and the client's state and pools,
apart from the transport.

Each call is a generator that yields steps (`r3store_client.steps`: `Send` one HTTP
request, `Sleep` before a retry, `Work` on the CPU) and is sent back each step's
outcome, or has its error thrown in. `Client` runs the steps blocking (`blocking`);
`AsyncClient` awaits the requests and sleeps and runs the CPU work (validating and
encoding uploads, decoding answers, the object store's ranged reads) on threads it owns
(`awaiting`), so a rollout loop's other coroutines keep running.

Only retryable failures are retried (connection errors, 408, 429, 502, 503, 504), with
exponential backoff and the server's Retry-After, and only for idempotent calls:
uploads are (the server acknowledges stored content again), `sample` is not (it is sent
again only if it never reached the server). Errors are the project's own exceptions
(`r3store.errors`), chosen by the code the server sends.
"""

from __future__ import annotations

import functools
import os
import random
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, Generic, ParamSpec, Protocol, TypeVar

import httpx
import urllib3

from r3store.errors import R3StoreError, StoreError, error_class
from r3store.logic.codec import Dictionaries
from r3store.protocol.direct import WritePlanModel
from r3store.spec import RouteSpec
from r3store_client.put_lanes import Lanes
from r3store_client.steps import Call, Send, Sleep, T

P = ParamSpec("P")

# 408: the server gave up on a body that arrived too slowly (a stalled network): sent again
RETRY_STATUS = {408, 429, 502, 503, 504}
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


class Blocking(Protocol):
    """A transport that runs a call to its end in the caller's thread (`Client`)."""

    def _run(self, call: Call[T], /) -> T: ...


class Awaiting(Protocol):
    """A transport that runs a call to its end as a coroutine (`AsyncClient`)."""

    async def _run(self, call: Call[T], /) -> T: ...


def blocking(
    call: Callable[Concatenate[Any, P], Call[T]],
) -> Callable[Concatenate[Blocking, P], T]:
    """A call as a method that runs it to its end (`Client`)."""

    def method(self: Blocking, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(call(self, *args, **kwargs))

    return _named(method, call)


def awaiting(
    call: Callable[Concatenate[Any, P], Call[T]],
) -> Callable[Concatenate[Awaiting, P], Coroutine[Any, Any, T]]:
    """A call as a coroutine method that runs it to its end (`AsyncClient`)."""

    async def method(self: Awaiting, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(call(self, *args, **kwargs))

    return _named(method, call)


M = TypeVar("M", bound=Callable[..., Any])


def _named(method: M, call: Callable[..., Any]) -> M:
    """`method` under the call's public name, with its docstring and signature."""
    functools.update_wrapper(method, call)
    method.__name__ = call.__name__.lstrip("_")
    return method


@dataclass(frozen=True)
class Retry:
    """`Retry(attempts=5, backoff=0.2, max_backoff=10.0)`: waits 0.2, 0.4, 0.8, ... s
    (with jitter, at least the server's Retry-After) between attempts."""

    attempts: int = 5
    backoff: float = 0.2
    max_backoff: float = 10.0

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        wait = min(self.max_backoff, self.backoff * 2.0**attempt) * (0.5 + random.random() / 2)
        return float(max(wait, retry_after or 0.0))


def with_status(error: R3StoreError, status: int) -> R3StoreError:
    """`error`, noting the HTTP status the server answered it with."""
    error.status = status
    return error


def raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json()["error"]
        code, message = str(detail["code"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", f"HTTP {response.status_code}: {response.text[:200]}"
    raise with_status(error_class(code)(message), response.status_code)


class CallBase:
    """The client's settings, connections and thread pools, and the request every call
    sends (`_request`, `_json`); the calls are mixed in over it (`Calls`)."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        retry: Retry | None,
        encode: bool,
        store_http: urllib3.PoolManager | None = None,
        direct_writes: bool | None = None,
        put_lanes: int | None = 2,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.direct_writes = direct_writes
        self._lanes = None if put_lanes is None else Lanes(put_lanes)  # `put_lanes`
        self._writes_direct: bool | None = None  # what direct writes chose (None: not yet)
        # unused write plans commits answered, per namespace (`direct_writes`)
        self._plans: dict[str, list[WritePlanModel]] = {}
        self._seen_plans: dict[str, WritePlanModel] = {}  # the last used, per namespace
        self._plans_lock = threading.Lock()
        self.api_key = api_key
        self.timeout = timeout
        self.retry = retry or Retry()
        self.encode = encode
        self._specs: dict[str, RouteSpec] = {}
        self._decoders: ThreadPoolExecutor | None = None
        self._store_http = store_http  # the object store's connections (direct reads)
        self._own_store_http = store_http is None
        self._fetchers: ThreadPoolExecutor | None = None
        self._made = threading.Lock()  # lazy connections and pools: one each, whoever asks
        self._dictionaries: Dictionaries = {}  # by digest: they never change (`direct_reads`)

    # pools

    @property
    def decoders(self) -> ThreadPoolExecutor:
        """Threads that decode read answers (zstd and numpy release the GIL)."""
        with self._made:
            if self._decoders is None:
                self._decoders = ThreadPoolExecutor(
                    min(8, os.cpu_count() or 1), thread_name_prefix="r3store-decode"
                )
            return self._decoders

    def _direct(self) -> tuple[urllib3.PoolManager, ThreadPoolExecutor]:
        """The object store's connections and the threads that fetch from it."""
        with self._made:
            if self._store_http is None:
                seconds = self.timeout if isinstance(self.timeout, int | float) else 60.0
                self._store_http = urllib3.PoolManager(
                    maxsize=8, timeout=urllib3.Timeout(connect=10.0, read=seconds), retries=False
                )
            if self._fetchers is None:
                self._fetchers = ThreadPoolExecutor(8, thread_name_prefix="r3store-fetch")
            return self._store_http, self._fetchers

    def _close_pools(self) -> None:
        if self._store_http is not None and self._own_store_http:
            self._store_http.clear()
        self._store_http = None
        for pool in (self._fetchers, self._decoders):
            if pool is not None:
                pool.shutdown(wait=False)
        self._fetchers = self._decoders = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._made = threading.Lock()
        self._plans_lock = threading.Lock()

    def _unpicklable(self) -> tuple[str, ...]:
        return ("_decoders", "_store_http", "_fetchers")

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in self._unpicklable():
            state[name] = None  # connections and threads do not cross processes
        state["_own_store_http"] = True
        state["_plans"] = state["_seen_plans"] = {}  # a plan is used once, in one process
        del state["_made"], state["_plans_lock"]
        return state

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # the request, retried

    def _request(
        self, /, method: str, path: str, *, idempotent: bool = True, **kwargs: Any
    ) -> Call[httpx.Response]:
        """Send a request, retrying what may succeed later; raise the server's error.

        A request that is not `idempotent` (sampling counts each time it is answered)
        is sent again only when it certainly never reached the server.
        """
        kwargs["headers"] = {**self._headers(), **kwargs.pop("headers", {})}
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                response: httpx.Response = yield Send(method, path, kwargs)
            except httpx.TransportError as exc:
                if last or not (idempotent or isinstance(exc, NEVER_SENT)):
                    raise StoreError(f"r3store at {self.base_url} unreachable: {exc}") from exc
                yield Sleep(self.retry.delay(attempt))
                continue
            if response.status_code in RETRY_STATUS and idempotent and not last:
                after = response.headers.get("retry-after")
                wait = float(after) if after and after.isdigit() else None
                yield Sleep(self.retry.delay(attempt, wait))
                continue
            raise_for(response)
            return response
        raise R3StoreError("unreachable")  # the loop always returns or raises

    def _json(self, method: str, path: str, **kwargs: Any) -> Call[Any]:
        return (yield from self._request(method, path, **kwargs)).json()


H = TypeVar("H", httpx.Client, httpx.AsyncClient)


class Transport(CallBase, Generic[H]):
    """What `Client` and `AsyncClient` share: their HTTP client (`H`), the one given or
    their own, opened on first use; a pickled client drops it and opens its own."""

    _http: H | None
    _own_http: bool

    def _connect(self, http: H | None) -> None:
        self._http = http
        self._own_http = http is None

    def _opened(self, make: Callable[..., H]) -> H:
        """The HTTP client, made by `make` (`httpx.Client` or `httpx.AsyncClient`) with
        this client's base URL and timeout if there is none yet."""
        with self._made:
            if self._http is None:
                self._http = make(base_url=self.base_url, timeout=self.timeout)
                self._own_http = True
            return self._http

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_own_http"] = True
        return state

    def _unpicklable(self) -> tuple[str, ...]:
        return (*super()._unpicklable(), "_http")
