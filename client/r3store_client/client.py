"""A synchronous client over httpx.

    client = Client("http://r3store:8330", api_key=os.environ["R3STORE_KEY"])
    client.put("run1", [TrajectoryWrite("p0/s0", 4096, topk=ids)])
    batch = client.get_batch("run1", ["p0/s0"])

Pass `http=httpx.Client(transport=httpx.ASGITransport(app))`-style clients in tests. Only
retryable failures are retried (connection errors, 429, 502, 503, 504), with
exponential backoff and the server's Retry-After, and only for idempotent calls:
uploads are (the server acknowledges stored content again), `sample` is not (it is
sent again only if it never reached the server). Uploads are encoded here, with the
engine's own validation and codec (a rollout worker's CPU instead of the server's, and
about six times fewer bytes than int32 ids on the wire); the server checks the streams by
decoding them. `encode=False` sends the ids as they are; either way the client checks
each array's shape against the namespace's spec first (its bytes alone would fit a
transposed array). Errors are the project's own exceptions
(`r3store.errors`), chosen by the code the server sends. A pickled client (DataLoader
workers) drops its connection and opens a new one on first use.
"""

from __future__ import annotations

import dataclasses
import os
import random
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt
import urllib3

from r3store.codec import Dictionaries, decode_tokens, load_dictionary
from r3store.errors import (
    Conflict,
    Forbidden,
    InvalidRoutes,
    NotFound,
    R3StoreError,
    StoreError,
    error_class,
)
from r3store.models import (
    AgreementModel,
    DriftModel,
    ExpertLoadModel,
    NamespacePublic,
    PolicyVersionSet,
    ReadPlanModel,
    TrajectoryLoadsModel,
)
from r3store.plans import Fetched, ReadPlan, reads_of
from r3store.policy import NamespaceSettings, Source
from r3store.records import Batch, PutResult, TrajectoryWrite
from r3store.sampling import Strategy
from r3store.spec import RouteSpec
from r3store.store.base import ByteRange
from r3store.streams import fits
from r3store.wire import CONTENT_TYPE, ReadFormat, decode_batch, encode_writes

# 408: the server gave up on a body that arrived too slowly (a stalled network): sent again
RETRY_STATUS = {408, 429, 502, 503, 504}


class _Replan(Exception):
    """A planned read the object store refused (its URL expired, or its object moved)."""


NEVER_SENT = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)


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


def _with_status(error: R3StoreError, status: int) -> R3StoreError:
    error.status = status  # type: ignore[attr-defined]
    return error


def _raise_for(response: httpx.Response) -> None:
    if response.status_code < 400:
        return
    try:
        detail = response.json()["error"]
        code, message = str(detail["code"]), str(detail["message"])
    except (ValueError, KeyError, TypeError):
        code, message = "http_error", f"HTTP {response.status_code}: {response.text[:200]}"
    raise _with_status(error_class(code)(message), response.status_code)


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


class Client:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8330",
        api_key: str | None = None,
        *,
        http: httpx.Client | None = None,
        timeout: float | httpx.Timeout = 60.0,
        retry: Retry | None = None,
        encode: bool = True,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout = timeout
        self.retry = retry or Retry()
        self.encode = encode
        self._specs: dict[str, RouteSpec] = {}
        self._http = http
        self._own_http = http is None
        self._decoders: ThreadPoolExecutor | None = None
        self._store_http: urllib3.PoolManager | None = None
        self._fetchers: ThreadPoolExecutor | None = None
        self._made = threading.Lock()  # lazy connections and pools: one each, whoever asks
        self._dictionaries: Dictionaries = {}  # by digest: they never change

    # connection

    @property
    def http(self) -> httpx.Client:
        with self._made:
            if self._http is None:
                self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout)
                self._own_http = True
            return self._http

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

    def close(self) -> None:
        if self._http is not None and self._own_http:
            self._http.close()
        self._http = None
        if self._store_http is not None:
            self._store_http.clear()
            self._store_http = None
        if self._fetchers is not None:
            self._fetchers.shutdown(wait=False)
            self._fetchers = None
        if self._decoders is not None:
            self._decoders.shutdown(wait=False)
            self._decoders = None

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_http"] = None  # connections and threads do not cross processes
        state["_own_http"] = True
        state["_decoders"] = None
        state["_store_http"] = None
        state["_fetchers"] = None
        del state["_made"]
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._made = threading.Lock()

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def request(
        self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """Send a request, retrying what may succeed later; raise the server's error.

        A request that is not `idempotent` (sampling counts each time it is answered)
        is sent again only when it certainly never reached the server.
        """
        headers = {**self._headers(), **kwargs.pop("headers", {})}
        for attempt in range(self.retry.attempts):
            last = attempt == self.retry.attempts - 1
            try:
                response = self.http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as exc:
                if last or not (idempotent or isinstance(exc, NEVER_SENT)):
                    raise StoreError(f"r3store at {self.base_url} unreachable: {exc}") from exc
                time.sleep(self.retry.delay(attempt))
                continue
            if response.status_code in RETRY_STATUS and idempotent and not last:
                after = response.headers.get("retry-after")
                wait = float(after) if after and after.isdigit() else None
                time.sleep(self.retry.delay(attempt, wait))
                continue
            _raise_for(response)
            return response
        raise R3StoreError("unreachable")  # the loop always returns or raises

    # namespaces

    def create_namespace(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> NamespacePublic:
        body = {
            "name": name,
            "spec": spec.__dict__,
            "settings": (settings or NamespaceSettings()).model_dump(mode="json"),
        }
        return NamespacePublic.model_validate(
            self.request("POST", "/v1/namespaces", json=body).json()
        )

    def namespace(self, name: str) -> NamespacePublic:
        return NamespacePublic.model_validate(self.request("GET", f"/v1/namespaces/{name}").json())

    def ensure_namespace(self, name: str, spec: RouteSpec) -> NamespacePublic:
        """The namespace `name`, which must have `spec`: created (with default settings)
        when it does not exist. Its settings are not compared: they are the operator's
        to change (`r3store settings`), and a worker started again afterwards goes on.

        Reading the namespace needs any role (`writer`, `reader` or `admin`); creating it
        needs `admin` (`Forbidden` says so). Another spec under the name: `Conflict`
        naming the fields that differ.
        """
        try:
            info = self.namespace(name)
        except NotFound:
            try:
                return self._keep_spec(name, self.create_namespace(name, spec))
            except Forbidden as exc:
                raise _with_status(
                    Forbidden(
                        f"namespace {name!r} does not exist and this key may not create it: "
                        f"creating a namespace needs an admin key (an operator can run "
                        f"`r3store namespaces create {name} ...`); {exc}"
                    ),
                    403,
                ) from None
            except Conflict:  # made meanwhile by someone else: compare with theirs
                info = self.namespace(name)
        stored = info.spec.to_spec()
        differing = [
            f"{f.name} {getattr(stored, f.name)!r} (asked: {getattr(spec, f.name)!r})"
            for f in dataclasses.fields(RouteSpec)
            if getattr(stored, f.name) != getattr(spec, f.name)
        ]
        if differing:
            raise _with_status(
                Conflict(
                    f"namespace {name!r} exists with another route spec: " + ", ".join(differing)
                ),
                409,
            )
        return self._keep_spec(name, info)

    def _keep_spec(self, name: str, info: NamespacePublic) -> NamespacePublic:
        self._specs[name] = info.spec.to_spec()
        return info

    def spec(self, name: str) -> RouteSpec:
        """The namespace's route spec (fixed at creation: asked once, then kept)."""
        if name not in self._specs:
            self._specs[name] = self.namespace(name).spec.to_spec()
        return self._specs[name]

    def set_policy_version(self, name: str, version: int, force: bool = False) -> NamespacePublic:
        """Move the namespace's policy version forward (a `trainer` key), at most the
        server's step per call; `force` (an admin key): set it as given, even back."""
        body = PolicyVersionSet(policy_version=version, force=force).model_dump(
            exclude_defaults=True
        )
        response = self.request("PUT", f"/v1/namespaces/{name}/policy-version", json=body)
        return NamespacePublic.model_validate(response.json())

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespacePublic:
        body = settings.model_dump(mode="json")
        response = self.request("PUT", f"/v1/namespaces/{name}/settings", json=body)
        return NamespacePublic.model_validate(response.json())

    # data

    def put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> list[PutResult]:
        """Upload trajectories (or appended segments); returns after the durable commit.
        Each array's shape is checked against the namespace's spec, and routes are
        validated and encoded here (unless `encode=False`): bad ones raise
        `InvalidRoutes` before anything is sent."""
        spec = self.spec(namespace)
        for w in writes:
            check_shape(w, spec)
        if self.encode:  # a segment too long to be checked by decoding goes as ids
            writes = [w.encode(spec) if fits(spec, w.num_tokens) else w for w in writes]
        response = self.request(
            "POST",
            f"/v1/namespaces/{namespace}/trajectories",
            content=encode_writes(writes),
            headers={"Content-Type": CONTENT_TYPE},
        )
        return [PutResult(**item) for item in response.json()["results"]]

    def get_batch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
    ) -> Batch:
        """Routes of `ids` in the order asked; `missing` and `stale` name the others.
        `decode=False` keeps the stored streams (`tensors.compact` decodes them).
        Each trajectory comes from one route source (`TrajectoryRead.source`): `source`
        if given, else the first of the namespace's `read_sources` it holds."""
        return self.fetch(namespace, ids, include_stale, fmt, decode, source)[1]

    def fetch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
    ) -> tuple[RouteSpec, Batch]:
        """Like `get_batch`, with the namespace's route spec."""
        body = {
            "ids": list(ids),
            "include_stale": include_stale,
            "format": str(fmt),
            "source": source,
        }
        response = self.request("POST", f"/v1/namespaces/{namespace}/routes/batch", json=body)
        return decode_batch(response.content, decode=decode, executor=self.decoders)

    def token_ids(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> dict[str, npt.NDArray[np.int32] | None]:
        """The token ids stored with `ids`, by id (`[num_tokens]` int32, -1 where a
        segment came without them; None for a trajectory stored without any); missing
        and stale ids are left out. Only the token streams are decoded, not the routes;
        the routes' stored streams still travel with them (the read endpoint has no
        tokens-only form)."""
        batch = self.get_batch(namespace, ids, include_stale, decode=False, source=source)
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

    def plan(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        expires: int = 60,
        source: Source | None = None,
    ) -> ReadPlan:
        """Where the routes of `ids` lie in the object store, with URLs that read them
        (S3-backed servers; `InvalidInput` from the embedded store)."""
        body = {
            "ids": list(ids),
            "include_stale": include_stale,
            "expires": expires,
            "source": source,
        }
        response = self.request("POST", f"/v1/namespaces/{namespace}/routes/plan", json=body)
        return ReadPlanModel.model_validate(response.json()).to_plan()

    def fetch_direct(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> tuple[RouteSpec, Batch]:
        """Like `fetch(..., decode=False)`, the bytes read from the object store itself
        (ranges in parallel): the server only looks them up. URLs that expired or an
        object compacted away meanwhile: planned again, once."""
        for attempt in range(2):
            plan = self.plan(namespace, ids, include_stale, source=source)
            try:
                fetched = self._fetch_objects(plan)
                return plan.spec, reads_of(plan, fetched, self._dictionaries_of(plan))
            except _Replan:
                if attempt:
                    raise StoreError("the object store refused the planned reads twice") from None
        raise R3StoreError("unreachable")

    def _dictionaries_of(self, plan: ReadPlan) -> Dictionaries:
        """The dictionaries a plan's streams need: fetched once, checked against their
        digests, and kept (they never change)."""
        store, _fetchers = self._direct()
        out: Dictionaries = {}
        for planned in plan.dictionaries:
            known = self._dictionaries.get(planned.digest)
            if known is None:
                try:
                    response = store.request("GET", planned.url)
                except urllib3.exceptions.HTTPError as exc:
                    raise StoreError(f"cannot read from the object store: {exc}") from None
                if response.status in (403, 404):
                    raise _Replan
                if response.status != 200:
                    raise StoreError(f"the object store answered {response.status}")
                known = load_dictionary(response.data, planned.digest)
                self._dictionaries[planned.digest] = known
            out[planned.digest] = known
        return out

    def _fetch_objects(self, plan: ReadPlan) -> list[Fetched]:
        """Each object's planned ranges, fetched in parallel (urllib3: about twice as
        fast as httpx on megabyte bodies)."""
        store, fetchers = self._direct()
        jobs = [(i, r) for i, o in enumerate(plan.objects) for r in o.ranges]

        def get(job: tuple[int, ByteRange]) -> bytes:
            index, byte_range = job
            headers = {"Range": f"bytes={byte_range.start}-{byte_range.end - 1}"}
            try:
                response = store.request("GET", plan.objects[index].url, headers=headers)
            except urllib3.exceptions.HTTPError as exc:
                raise StoreError(f"cannot read from the object store: {exc}") from None
            if response.status in (403, 404):  # expired, or compacted away
                raise _Replan
            if response.status not in (200, 206):
                raise StoreError(f"the object store answered {response.status}")
            data: bytes = response.data
            if response.status == 200:  # the whole object: a store that ignores Range
                data = data[byte_range.start : byte_range.end]
            if len(data) != byte_range.length:
                raise StoreError("the object store returned a short range")
            return data

        fetched = [Fetched() for _ in plan.objects]
        for (index, byte_range), data in zip(jobs, fetchers.map(get, jobs), strict=True):
            fetched[index].add(byte_range, data)
        return fetched

    def sample(
        self,
        namespace: str,
        n: int,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        seed: int | None = None,
    ) -> Batch:
        """Take up to `n` trajectories; each counts toward the namespace's sampling cap.

        Not retried after the server may have acted on it (a retry would count twice):
        a `StoreError` here means the outcome is unknown.
        """
        body = {"n": n, "strategy": str(strategy), "whole_groups": whole_groups, "seed": seed}
        response = self.request(
            "POST", f"/v1/namespaces/{namespace}/routes/sample", json=body, idempotent=False
        )
        return decode_batch(response.content, executor=self.decoders)[1]

    # statistics

    def expert_load(
        self, namespace: str, source: Source = "engine", versions: tuple[int, int] | None = None
    ) -> ExpertLoadModel:
        """Expert load per policy version (optionally those in `versions`, inclusive)."""
        params: dict[str, Any] = {"source": source}
        if versions is not None:
            params["min_version"], params["max_version"] = versions
        response = self.request("GET", f"/v1/namespaces/{namespace}/stats/experts", params=params)
        return ExpertLoadModel.model_validate(response.json())

    def agreement(
        self, namespace: str, a: Source = "engine", b: Source = "trainer"
    ) -> AgreementModel:
        """Agreement per policy version and layer between two route sources."""
        params = {"a": a, "b": b}
        response = self.request("GET", f"/v1/namespaces/{namespace}/stats/agreement", params=params)
        return AgreementModel.model_validate(response.json())

    def drift(self, namespace: str, source: Source = "engine") -> DriftModel:
        """Per-layer divergence of expert load from each policy version to the next."""
        response = self.request(
            "GET", f"/v1/namespaces/{namespace}/stats/drift", params={"source": source}
        )
        return DriftModel.model_validate(response.json())

    def trajectory_loads(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> TrajectoryLoadsModel:
        """Per-expert token counts of each trajectory's routes (as a read would serve
        them), to balance micro-batches across expert-parallel ranks."""
        body = {"ids": list(ids), "include_stale": include_stale, "source": source}
        response = self.request(
            "POST", f"/v1/namespaces/{namespace}/stats/experts/trajectories", json=body
        )
        return TrajectoryLoadsModel.model_validate(response.json())
