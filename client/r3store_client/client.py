"""A synchronous client over httpx.

    client = Client("http://r3store:8330", api_key=os.environ["R3STORE_KEY"])
    refs = [r.ref for r in client.put("run1", [TrajectoryWrite("p0/s0", 4096, topk=ids)])]
    batch = client.get_batch("run1", ["p0/s0"])
    spec, mine = client.resolve(refs)                 # route refs, checked (`r3store.refs`)

Pass `http=httpx.Client(transport=httpx.ASGITransport(app))`-style clients in tests.
What each call sends, how it is retried and how its answer is read is shared with
`AsyncClient` (`r3store_client.calls`); this module only runs the calls, blocking.
Uploads are encoded here, with the engine's own validation and codec (a rollout worker's
CPU instead of the server's, and about six times fewer bytes than int32 ids on the
wire); the server checks the streams by decoding them. `encode=False` sends the ids as
they are; either way the client checks each array's shape against the namespace's spec
first (its bytes alone would fit a transposed array). A pickled client (DataLoader
workers) drops its connection and opens a new one on first use.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx
import numpy as np
import numpy.typing as npt

from r3store.models import (
    AgreementModel,
    DriftModel,
    ExpertLoadModel,
    NamespacePublic,
    TrajectoryLoadsModel,
)
from r3store.plans import ReadPlan
from r3store.policy import NamespaceSettings, Source
from r3store.records import Batch, PutResult, TrajectoryWrite
from r3store.refs import RouteRef
from r3store.sampling import Strategy
from r3store.spec import RouteSpec
from r3store.wire import ReadFormat
from r3store_client.calls import Call, Calls, Retry, Send, Sleep, T, check_shape

__all__ = ["Client", "Retry", "check_shape"]


class Client(Calls):
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
        super().__init__(base_url, api_key, timeout, retry, encode)
        self._http = http
        self._own_http = http is None

    # connection

    @property
    def http(self) -> httpx.Client:
        with self._made:
            if self._http is None:
                self._http = httpx.Client(base_url=self.base_url, timeout=self.timeout)
                self._own_http = True
            return self._http

    def close(self) -> None:
        if self._http is not None and self._own_http:
            self._http.close()
        self._http = None
        self._close_pools()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        state["_own_http"] = True
        return state

    def _unpicklable(self) -> tuple[str, ...]:
        return (*super()._unpicklable(), "_http")

    def _run(self, call: Call[T]) -> T:
        """Run a call's steps in this thread."""
        value: Any = None
        error: Exception | None = None
        try:
            while True:
                try:
                    step = call.throw(error) if error is not None else call.send(value)
                except StopIteration as done:
                    return done.value  # type: ignore[no-any-return]
                value, error = None, None
                try:
                    if isinstance(step, Send):
                        value = self.http.request(step.method, step.path, **step.kwargs)
                    elif isinstance(step, Sleep):
                        time.sleep(step.seconds)
                    else:
                        value = step.fn(*step.args)
                except Exception as exc:  # noqa: BLE001  (the call raises it, or retries)
                    error = exc
        finally:
            call.close()

    def request(
        self, method: str, path: str, *, idempotent: bool = True, **kwargs: Any
    ) -> httpx.Response:
        """Send a request, retrying what may succeed later; raise the server's error.
        A request that is not `idempotent` is sent again only when it certainly never
        reached the server."""
        return self._run(self._request(method, path, idempotent=idempotent, **kwargs))

    # namespaces

    def create_namespace(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> NamespacePublic:
        return self._run(self._create_namespace(name, spec, settings))

    def namespace(self, name: str) -> NamespacePublic:
        return self._run(self._namespace(name))

    def ensure_namespace(self, name: str, spec: RouteSpec) -> NamespacePublic:
        """The namespace `name`, which must have `spec`: created (with default settings)
        when it does not exist. Its settings are not compared: they are the operator's
        to change (`r3store settings`), and a worker started again afterwards goes on.

        Reading the namespace needs any role (`writer`, `reader` or `admin`); creating it
        needs `admin` (`Forbidden` says so). Another spec under the name: `Conflict`
        naming the fields that differ.
        """
        return self._run(self._ensure_namespace(name, spec))

    def spec(self, name: str) -> RouteSpec:
        """The namespace's route spec (fixed at creation: asked once, then kept)."""
        return self._run(self._spec(name))

    def set_policy_version(self, name: str, version: int, force: bool = False) -> NamespacePublic:
        """Move the namespace's policy version forward (a `trainer` key), at most the
        server's step per call; `force` (an admin key): set it as given, even back."""
        return self._run(self._set_policy_version(name, version, force))

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespacePublic:
        return self._run(self._update_settings(name, settings))

    # data

    def put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> list[PutResult]:
        """Upload trajectories (or appended segments); returns after the durable commit,
        a result per write with its route ref (`PutResult.ref`). Each array's shape is
        checked against the namespace's spec, and routes are validated and encoded here
        (unless `encode=False`): bad ones raise `InvalidRoutes` before anything is
        sent."""
        return self._run(self._put(namespace, writes))

    def get_batch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Batch:
        """Routes of `ids` in the order asked; `missing` and `stale` name the others.
        `decode=False` keeps the stored streams (`tensors.compact` decodes them).
        Each trajectory comes from one route source (`TrajectoryRead.source`): `source`
        if given, else the first of the namespace's `read_sources` it holds. `layers`
        (distinct increasing indices): only those layers' routes travel and are
        returned (`Batch.layers`), for a pipeline stage's routers."""
        return self.fetch(namespace, ids, include_stale, fmt, decode, source, layers)[1]

    def fetch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> tuple[RouteSpec, Batch]:
        """Like `get_batch`, with the route spec of the answer (the namespace's, its
        `num_layers` those asked when `layers` is given)."""
        return self._run(self._fetch(namespace, ids, include_stale, fmt, decode, source, layers))

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
        return self._run(self._token_ids(namespace, ids, include_stale, source))

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
        return self._run(self._plan(namespace, ids, include_stale, expires, source))

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
        return self._run(self._fetch_direct(namespace, ids, include_stale, source))

    def resolve(
        self,
        refs: Sequence[RouteRef],
        include_stale: bool = False,
        direct: bool = False,
        layers: Sequence[int] | None = None,
    ) -> tuple[RouteSpec, Batch]:
        """The routes `refs` name (of one namespace), in their order, each trajectory
        only the segments its ref names, as stored streams (`tensors.compact` decodes
        them). Only these trajectories are read, and with `layers` only those layers
        (a pipeline stage's; `MegatronReplay.layers`); `direct`: from the object store,
        as `fetch_direct`. A ref whose trajectory is gone or stale, or stored with other
        content since, raises `RefMismatch` naming it."""
        return self._run(self._resolve(refs, include_stale, direct, layers))

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
        return self._run(self._sample(namespace, n, strategy, whole_groups, seed))

    # statistics

    def expert_load(
        self, namespace: str, source: Source = "engine", versions: tuple[int, int] | None = None
    ) -> ExpertLoadModel:
        """Expert load per policy version (optionally those in `versions`, inclusive)."""
        return self._run(self._expert_load(namespace, source, versions))

    def agreement(
        self, namespace: str, a: Source = "engine", b: Source = "trainer"
    ) -> AgreementModel:
        """Agreement per policy version and layer between two route sources."""
        return self._run(self._agreement(namespace, a, b))

    def drift(self, namespace: str, source: Source = "engine") -> DriftModel:
        """Per-layer divergence of expert load from each policy version to the next."""
        return self._run(self._drift(namespace, source))

    def trajectory_loads(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> TrajectoryLoadsModel:
        """Per-expert token counts of each trajectory's routes (as a read would serve
        them), to balance micro-batches across expert-parallel ranks."""
        return self._run(self._trajectory_loads(namespace, ids, include_stale, source))
