"""What every client call sends and how its answer is read, apart from the transport.

Each call is a generator that yields steps (`r3store_client.steps`: `Send` one HTTP
request, `Sleep` before a retry, `Work` on the CPU) and is sent back each step's
outcome, or has its error thrown in. `Client` runs the steps blocking; `AsyncClient`
awaits the requests and sleeps and runs the CPU work (validating and encoding
uploads, decoding answers, the object store's ranged reads) on threads it owns, so a
rollout loop's other coroutines keep running. Retries, request building, validation
and answer parsing are written once, here.

Only retryable failures are retried (connection errors, 408, 429, 502, 503, 504), with
exponential backoff and the server's Retry-After, and only for idempotent calls:
uploads are (the server acknowledges stored content again), `sample` is not (it is sent
again only if it never reached the server). Errors are the project's own exceptions
(`r3store.errors`), chosen by the code the server sends.

One module on purpose (over 500 lines): every call's request, retries and answer
parsing, written once for both transports (`Client`, `AsyncClient`); split by call, the
calls would be parted from the retry and error rules they all follow.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import random
import threading
from collections.abc import Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Concatenate, ParamSpec, TypeVar

import httpx
import numpy as np
import numpy.typing as npt
import urllib3

from r3store.errors import (
    Conflict,
    Forbidden,
    InvalidInput,
    InvalidRoutes,
    NotFound,
    R3StoreError,
    RefMismatch,
    StoreError,
    error_class,
)
from r3store.logic.codec import Dictionaries, Dictionary, decode_tokens, load_dictionary
from r3store.logic.sampling import Strategy
from r3store.logic.spans import ByteRange
from r3store.logic.streams import fits
from r3store.logic.writes import encode_write
from r3store.policy import NamespaceSettings, Source
from r3store.protocol.direct import WritePlanModel
from r3store.protocol.models import (
    AgreementModel,
    DriftModel,
    ExpertLoadModel,
    NamespacePublic,
    PolicyVersionSet,
    PutItem,
    ReadPlanModel,
    TrajectoryLoadsModel,
)
from r3store.protocol.plans import Fetched, ReadPlan, reads_of
from r3store.protocol.wire import CONTENT_TYPE, ReadFormat, decode_batch, encode_writes
from r3store.records import Batch, PutResult, TrajectoryWrite
from r3store.refs import RouteRef, by_source, resolve
from r3store.spec import RouteSpec
from r3store_client.direct_writes import DirectWrites
from r3store_client.lease_calls import LeaseCalls
from r3store_client.steps import Call, Send, Sleep, T, Work

log = logging.getLogger("r3store_client")
P = ParamSpec("P")

# 408: the server gave up on a body that arrived too slowly (a stalled network): sent again
RETRY_STATUS = {408, 429, 502, 503, 504}
NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


def blocking(call: Callable[Concatenate[Any, P], Call[T]]) -> Callable[Concatenate[Any, P], T]:
    """A call as a method that runs it to its end (`Client`)."""

    def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self._run(call(self, *args, **kwargs))  # type: ignore[no-any-return]

    return _named(method, call)


def awaiting(
    call: Callable[Concatenate[Any, P], Call[T]],
) -> Callable[Concatenate[Any, P], Coroutine[Any, Any, T]]:
    """A call as a coroutine method that runs it to its end (`AsyncClient`)."""

    async def method(self: Any, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self._run(call(self, *args, **kwargs))  # type: ignore[no-any-return]

    return _named(method, call)


M = TypeVar("M", bound=Callable[..., Any])


def _named(method: M, call: Callable[..., Any]) -> M:
    """`method` under the call's public name, with its docstring and signature."""
    functools.update_wrapper(method, call)
    method.__name__ = call.__name__.lstrip("_")
    return method


class _Replan(Exception):
    """A planned read the object store refused (its URL expired, or its object moved)."""


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
    error.status = status  # type: ignore[attr-defined]
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


def check_shape(write: TrajectoryWrite, spec: RouteSpec) -> None:
    """Refuse routes whose array is not `[num_tokens - 1 or num_tokens, layers, width]`
    (`InvalidRoutes` naming the expected and the given shape). Only the bytes travel, so
    a transposed `[layers, num_tokens - 1, top_k]` array of the same size would be read
    as other routes."""
    if write.encoded is not None or (write.topk is None and write.mask is None):
        return  # encoded streams are checked by decoding; none at all: `check` says so
    n = write.num_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return  # `check` names a bad token count
    routes = write.topk if write.topk is not None else write.mask
    kind, width, name = (
        ("top-k ids", spec.top_k, "top_k")
        if write.topk is not None
        else ("masks", spec.mask_bytes, "ceil(num_experts / 8)")
    )
    given = tuple(int(d) for d in np.shape(routes))
    if len(given) == 3 and given[0] in (n - 1, n) and given[1:] == (spec.num_layers, width):
        return
    raise InvalidRoutes(
        f"{write.trajectory_id}: {kind} of shape {list(given)}; expected "
        f"[{n - 1}, {spec.num_layers}, {width}] ([num_tokens - 1, layers, {name}]; "
        f"{n} rows also accepted) for {n} tokens"
    )


def encoded_writes(
    writes: Sequence[TrajectoryWrite], spec: RouteSpec, dictionary: Dictionary | None = None
) -> list[TrajectoryWrite]:
    """The writes with each array's shape checked against the spec and the routes
    validated and encoded as the engine would (bad ones raise `InvalidRoutes` before
    anything is sent; with the namespace's `dictionary` for a direct write); a segment
    too long to be checked by decoding stays as ids."""
    for w in writes:
        check_shape(w, spec)
    return [encode_write(w, spec, dictionary) if fits(spec, w.num_tokens) else w for w in writes]


def upload_body(writes: Sequence[TrajectoryWrite], spec: RouteSpec, encode: bool) -> bytes:
    """An upload's body: each array's shape checked against the spec, and (`encode`)
    the routes encoded (`encoded_writes`)."""
    if encode:
        return encode_writes(encoded_writes(writes, spec))
    for w in writes:
        check_shape(w, spec)
    return encode_writes(writes)


def token_ids_of(batch: Batch) -> dict[str, npt.NDArray[np.int32] | None]:
    out: dict[str, npt.NDArray[np.int32] | None] = {}
    for item in batch.found:
        parts = [
            None
            if s.encoded is None or s.encoded.tokens is None
            else decode_tokens(s.encoded.tokens, s.num_tokens)
            for s in item.segments
        ]
        out[item.trajectory_id] = (
            None
            if all(p is None for p in parts)
            else np.concatenate(
                [
                    np.full(s.num_tokens, -1, np.int32) if p is None else p
                    for s, p in zip(item.segments, parts, strict=True)
                ]
            )
        )
    return out


def _differing(name: str, stored: RouteSpec, asked: RouteSpec) -> None:
    differing = [
        f"{f.name} {getattr(stored, f.name)!r} (asked: {getattr(asked, f.name)!r})"
        for f in dataclasses.fields(RouteSpec)
        if getattr(stored, f.name) != getattr(asked, f.name)
    ]
    if differing:
        raise with_status(
            Conflict(f"namespace {name!r} exists with another route spec: " + ", ".join(differing)),
            409,
        )


class Calls(LeaseCalls, DirectWrites):
    """The client's state and its calls, for a transport to run (`Client`,
    `AsyncClient`); the lease calls are in `r3store_client.lease_calls`, direct writes
    in `r3store_client.direct_writes`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None,
        timeout: float | httpx.Timeout,
        retry: Retry | None,
        encode: bool,
        store_http: urllib3.PoolManager | None = None,
        direct_writes: bool | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.direct_writes = direct_writes
        self._writes_direct = None
        self._plans = {}
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
        self._dictionaries: Dictionaries = {}  # by digest: they never change

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
        state["_plans"] = {}  # a plan is used once: never by two processes
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

    # namespaces

    def _create_namespace(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> Call[NamespacePublic]:
        """Create a namespace (an admin key); `Conflict` when the name is taken."""
        body = {
            "name": name,
            "spec": spec.__dict__,
            "settings": (settings or NamespaceSettings()).model_dump(mode="json"),
        }
        answer = yield from self._json("POST", "/v1/namespaces", json=body)
        return NamespacePublic.model_validate(answer)

    def _namespace(self, name: str) -> Call[NamespacePublic]:
        """The namespace: its spec, settings, policy version and usage."""
        answer = yield from self._json("GET", f"/v1/namespaces/{name}")
        return NamespacePublic.model_validate(answer)

    def _ensure_namespace(self, name: str, spec: RouteSpec) -> Call[NamespacePublic]:
        """The namespace `name`, which must have `spec`: created (with default settings)
        when it does not exist. Its settings are not compared: they are the operator's
        to change (`r3store settings`), and a worker started again afterwards goes on.

        Reading the namespace needs any role (`writer`, `reader` or `admin`); creating it
        needs `admin` (`Forbidden` says so). Another spec under the name: `Conflict`
        naming the fields that differ.
        """
        try:
            info = yield from self._namespace(name)
        except NotFound:
            try:
                return self._keep_spec(name, (yield from self._create_namespace(name, spec)))
            except Forbidden as exc:
                raise with_status(
                    Forbidden(
                        f"namespace {name!r} does not exist and this key may not create it: "
                        f"creating a namespace needs an admin key (an operator can run "
                        f"`r3store namespaces create {name} ...`); {exc}"
                    ),
                    403,
                ) from None
            except Conflict:  # made meanwhile by someone else: compare with theirs
                info = yield from self._namespace(name)
        _differing(name, info.spec.to_spec(), spec)
        return self._keep_spec(name, info)

    def _keep_spec(self, name: str, info: NamespacePublic) -> NamespacePublic:
        self._specs[name] = info.spec.to_spec()
        return info

    def _spec(self, name: str) -> Call[RouteSpec]:
        """The namespace's route spec (fixed at creation: asked once, then kept)."""
        if name not in self._specs:
            self._specs[name] = (yield from self._namespace(name)).spec.to_spec()
        return self._specs[name]

    def _set_policy_version(
        self, name: str, version: int, force: bool = False
    ) -> Call[NamespacePublic]:
        """Move the namespace's policy version forward (a `trainer` key), at most the
        server's step per call; `force` (an admin key): set it as given, even back."""
        body = PolicyVersionSet(policy_version=version, force=force).model_dump(
            exclude_defaults=True
        )
        path = f"/v1/namespaces/{name}/policy-version"
        return NamespacePublic.model_validate((yield from self._json("PUT", path, json=body)))

    def _update_settings(self, name: str, settings: NamespaceSettings) -> Call[NamespacePublic]:
        """Replace the namespace's settings (an admin key)."""
        body = settings.model_dump(mode="json")
        path = f"/v1/namespaces/{name}/settings"
        return NamespacePublic.model_validate((yield from self._json("PUT", path, json=body)))

    # data

    def _put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> Call[list[PutResult]]:
        """Upload trajectories (or appended segments); returns after the durable commit,
        a result per write with its route ref (`PutResult.ref`). Each array's shape is
        checked against the namespace's spec, and routes are validated and encoded here
        (unless `encode=False`): bad ones raise `InvalidRoutes` before anything is
        sent. Encoded puts go straight to the object store where the server allows it
        (`direct_writes`; `r3store_client.direct_writes`)."""
        spec = yield from self._spec(namespace)
        items: list[PutItem] | None = None
        if (
            self.encode
            and self._chooses_direct()
            and all(isinstance(w.num_tokens, int) and fits(spec, w.num_tokens) for w in writes)
        ):
            for w in writes:
                check_shape(w, spec)
            items = yield from self._put_direct(namespace, spec, writes, encoded_writes)
        if items is None:
            body = yield Work(upload_body, (list(writes), spec, self.encode))
            answer = yield from self._json(
                "POST",
                f"/v1/namespaces/{namespace}/trajectories",
                content=body,
                headers={"Content-Type": CONTENT_TYPE},
            )
            items = [PutItem.model_validate(item) for item in answer["results"]]
        results = [item.result() for item in items]
        return [dataclasses.replace(r, ref=RouteRef.of(namespace, r)) for r in results]

    def _get_batch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Call[Batch]:
        """Routes of `ids` in the order asked; `missing` and `stale` name the others.
        `decode=False` keeps the stored streams (`tensors.compact` decodes them).
        Each trajectory comes from one route source (`TrajectoryRead.source`): `source`
        if given, else the first of the namespace's `read_sources` it holds. `layers`
        (distinct increasing indices): only those layers' routes travel and are
        returned (`Batch.layers`), for a pipeline stage's routers."""
        answer = yield from self._fetch(namespace, ids, include_stale, fmt, decode, source, layers)
        return answer[1]

    def _fetch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """Like `get_batch`, with the route spec of the answer (the namespace's, its
        `num_layers` those asked when `layers` is given)."""
        body: dict[str, Any] = {
            "ids": list(ids),
            "include_stale": include_stale,
            "format": str(fmt),
            "source": source,
        }
        if layers is not None:
            body["layers"] = list(layers)
        path = f"/v1/namespaces/{namespace}/routes/batch"
        response = yield from self._request("POST", path, json=body)
        answer: tuple[RouteSpec, Batch] = yield Work(
            decode_batch, (response.content, decode, self.decoders)
        )
        return answer

    def _token_ids(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[dict[str, npt.NDArray[np.int32] | None]]:
        """The token ids stored with `ids`, by id (`[num_tokens]` int32, -1 where a
        segment came without them; None for a trajectory stored without any); missing
        and stale ids are left out. Only the token streams are decoded, not the routes;
        the routes' stored streams still travel with them (the read endpoint has no
        tokens-only form)."""
        _spec, batch = yield from self._fetch(
            namespace, ids, include_stale, decode=False, source=source
        )
        out: dict[str, npt.NDArray[np.int32] | None] = yield Work(token_ids_of, (batch,))
        return out

    def _plan(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        expires: int = 60,
        source: Source | None = None,
    ) -> Call[ReadPlan]:
        """Where the routes of `ids` lie in the object store, with URLs that read them
        (S3-backed servers; `InvalidInput` from the embedded store)."""
        body = {
            "ids": list(ids),
            "include_stale": include_stale,
            "expires": expires,
            "source": source,
        }
        path = f"/v1/namespaces/{namespace}/routes/plan"
        answer = yield from self._json("POST", path, json=body)
        return ReadPlanModel.model_validate(answer).to_plan()

    def _fetch_direct(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """Like `fetch(..., decode=False)`, the bytes read from the object store itself
        (ranges in parallel): the server only looks them up. URLs that expired or an
        object compacted away meanwhile: planned again, once."""
        for attempt in range(2):
            plan = yield from self._plan(namespace, ids, include_stale, source=source)
            try:
                batch: Batch = yield Work(self._read_planned, (plan,))
                return plan.spec, batch
            except _Replan:
                if attempt:
                    raise StoreError("the object store refused the planned reads twice") from None
        raise R3StoreError("unreachable")

    def _resolve(
        self,
        refs: Sequence[RouteRef],
        include_stale: bool = False,
        direct: bool = False,
        layers: Sequence[int] | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """The routes `refs` name (of one namespace), in their order, each trajectory
        only the segments its ref names, as stored streams (`tensors.compact` decodes
        them). Only these trajectories are read, and with `layers` only those layers
        (a pipeline stage's; `MegatronReplay.needed_layers`); `direct`: from the object
        store, as `fetch_direct` (whole segments: not with `layers`, refused before any
        round trip). A ref whose trajectory is gone or stale (its namespace deleted
        included), or stored with other content or at another policy version than the
        ref says, raises `RefMismatch` naming it."""
        namespace, wanted = by_source(refs)
        if direct and layers is not None:
            raise InvalidInput(
                "a direct read fetches whole stored segments: select layers through the "
                "server (direct=False)"
            )
        reads: dict[Source, Batch] = {}
        try:
            for source, ids in wanted.items():
                if direct:
                    spec, reads[source] = yield from self._fetch_direct(
                        namespace, ids, include_stale, source
                    )
                else:
                    spec, reads[source] = yield from self._fetch(
                        namespace, ids, include_stale, decode=False, source=source, layers=layers
                    )
        except NotFound as exc:  # the namespace: gone, and every trajectory in it
            raise RefMismatch(
                f"{refs[0]}: the trajectory is no longer stored (its namespace: {exc})"
            ) from exc
        return spec, resolve(refs, reads)

    def _sample(
        self,
        namespace: str,
        n: int,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        seed: int | None = None,
    ) -> Call[Batch]:
        """Take up to `n` trajectories; each counts toward the namespace's sampling cap.

        Not retried after the server may have acted on it (a retry would count twice):
        a `StoreError` here means the outcome is unknown.
        """
        body = {"n": n, "strategy": str(strategy), "whole_groups": whole_groups, "seed": seed}
        path = f"/v1/namespaces/{namespace}/routes/sample"
        response = yield from self._request("POST", path, json=body, idempotent=False)
        answer: tuple[RouteSpec, Batch] = yield Work(
            decode_batch, (response.content, True, self.decoders)
        )
        return answer[1]

    # statistics

    def _expert_load(
        self, namespace: str, source: Source = "engine", versions: tuple[int, int] | None = None
    ) -> Call[ExpertLoadModel]:
        """Expert load per policy version (optionally those in `versions`, inclusive)."""
        params: dict[str, Any] = {"source": source}
        if versions is not None:
            params["min_version"], params["max_version"] = versions
        path = f"/v1/namespaces/{namespace}/stats/experts"
        return ExpertLoadModel.model_validate((yield from self._json("GET", path, params=params)))

    def _agreement(
        self, namespace: str, a: Source = "engine", b: Source = "trainer"
    ) -> Call[AgreementModel]:
        """Agreement per policy version and layer between two route sources."""
        path = f"/v1/namespaces/{namespace}/stats/agreement"
        answer = yield from self._json("GET", path, params={"a": a, "b": b})
        return AgreementModel.model_validate(answer)

    def _drift(self, namespace: str, source: Source = "engine") -> Call[DriftModel]:
        """Per-layer divergence of expert load from each policy version to the next."""
        path = f"/v1/namespaces/{namespace}/stats/drift"
        answer = yield from self._json("GET", path, params={"source": source})
        return DriftModel.model_validate(answer)

    def _trajectory_loads(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[TrajectoryLoadsModel]:
        """Per-expert token counts of each trajectory's routes (as a read would serve
        them), to balance micro-batches across expert-parallel ranks."""
        body = {"ids": list(ids), "include_stale": include_stale, "source": source}
        path = f"/v1/namespaces/{namespace}/stats/experts/trajectories"
        answer = yield from self._json("POST", path, json=body)
        return TrajectoryLoadsModel.model_validate(answer)

    # direct reads: the object store's ranged GETs (blocking: run as `Work`)

    def _read_planned(self, plan: ReadPlan) -> Batch:
        fetched = self._fetch_objects(plan)
        return reads_of(plan, fetched, self._dictionaries_of(plan))

    def _store_get(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One GET of a presigned URL: its status (200 or 206) and body. The one place
        urllib3's errors become the project's: a connection failure or another status is
        a `StoreError`; 403 or 404 (the URL expired, or its object was compacted away)
        asks for a new plan."""
        store, _fetchers = self._direct()
        try:
            # the bytes as stored: a Content-Encoding a writer set is not undone here
            response = store.request("GET", url, headers=headers, decode_content=False)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"cannot read from the object store: {exc}") from None
        if response.status in (403, 404):
            raise _Replan
        if response.status not in (200, 206):
            raise StoreError(f"the object store answered {response.status}")
        return response.status, response.data

    def _dictionaries_of(self, plan: ReadPlan) -> Dictionaries:
        """The dictionaries a plan's streams need: fetched once, checked against their
        digests, and kept (they never change)."""
        return {d.digest: self._dictionary(d.digest, d.url) for d in plan.dictionaries}

    def _dictionary(self, digest: bytes, url: str) -> Dictionary:
        """The dictionary `digest` names, read from a presigned `url` the first time and
        checked against the digest, then kept (a dictionary never changes)."""
        known = self._dictionaries.get(digest)
        if known is None:
            known = load_dictionary(self._store_get(url)[1], digest)
            self._dictionaries[digest] = known
        return known

    def _plan_dictionary(self, plan: WritePlanModel) -> Dictionary | None:
        """The dictionary a write plan names, or None when it names none or it cannot be
        read (the routes then go without one, as before the namespace had one)."""
        if plan.dictionary is None:
            return None
        try:
            return self._dictionary(bytes.fromhex(plan.dictionary.digest), plan.dictionary.url)
        except (_Replan, R3StoreError) as exc:
            log.warning(
                "r3store: the namespace's dictionary is not used: %s", exc or "refused by the store"
            )
            return None

    def _fetch_objects(self, plan: ReadPlan) -> list[Fetched]:
        """Each object's planned ranges, fetched in parallel (urllib3: about twice as
        fast as httpx on megabyte bodies)."""
        _store, fetchers = self._direct()
        jobs = [(i, r) for i, o in enumerate(plan.objects) for r in o.ranges]

        def get(job: tuple[int, ByteRange]) -> bytes:
            index, byte_range = job
            headers = {"Range": f"bytes={byte_range.start}-{byte_range.end - 1}"}
            status, data = self._store_get(plan.objects[index].url, headers)
            if status == 200:  # the whole object: a store that ignores Range
                data = data[byte_range.start : byte_range.end]
            if len(data) != byte_range.length:
                raise StoreError("the object store returned a short range")
            return data

        fetched = [Fetched() for _ in plan.objects]
        for (index, byte_range), data in zip(jobs, fetchers.map(get, jobs), strict=True):
            fetched[index].add(byte_range, data)
        return fetched
