"""Health, readiness and metrics endpoints, for orchestrators and Prometheus.

`/readyz` is open; without a valid key its detail names only the part that failed (the
object store or the catalog), not the endpoint, bucket or database. `/metrics` shows a
key scoped to some namespaces only those namespaces' series (and the server's own)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from starlette.concurrency import run_in_threadpool

from r3store.errors import R3StoreError
from r3store.protocol.models import Health
from r3store_server.auth import Principal
from r3store_server.deps import (
    KeyRingDep,
    PrincipalDep,
    SettingsDep,
    allowed,
    client_address,
    get_engine,
)
from r3store_server.errors import ERROR_RESPONSES
from r3store_server.limits import Deadline

router = APIRouter(tags=["operations"])


@router.get("/healthz", response_model=Health)
async def healthz() -> Health:
    """The process is up. Open to all."""
    return Health(status="ok")


@router.get(
    "/readyz",
    response_model=Health,
    responses={503: {"model": Health, "description": "store or catalog unreachable"}},
)
async def readyz(
    request: Request, settings: SettingsDep, keys: KeyRingDep
) -> Health | JSONResponse:
    """The object store and the catalog answer, within `R3STORE_READINESS_TIMEOUT`.
    Open to all; why not, in full, only with a valid key."""
    try:
        engine = await get_engine(request)
        await Deadline(settings.readiness_timeout).run(engine.ping, what="the readiness probe")
    except R3StoreError as exc:
        # off the event loop: the key ring may refresh its keys from a catalog in trouble
        known = await run_in_threadpool(_with_key, request, keys)
        detail = str(exc) if known else _briefly(request, str(exc))
        body = Health(status="unavailable", detail=detail)
        return JSONResponse(body.model_dump(), status_code=503)
    return Health(status="ready")


def _with_key(request: Request, keys: KeyRingDep) -> bool:
    """Whether the request sends a key the server knows (any role)."""
    presented = request.headers.get("x-api-key")
    scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
    if presented is None and scheme.lower() == "bearer":
        presented = credentials.strip()
    try:
        keys.authenticate(presented or None, client_address(request))
    except R3StoreError:  # unknown, refused, or the catalog could not say
        return False
    return True


def _briefly(request: Request, why: str) -> str:
    """What failed, without where: the part, and whether the service is still starting."""
    if "the catalog is unavailable" in why:
        failed = "the catalog is unavailable"
    elif "did not finish within" in why:
        failed = "the object store or the catalog did not answer in time"
    else:
        failed = "the object store is unavailable"
    opening: str | None = request.app.state.opening
    if opening is None:
        return failed
    if opening.startswith("cannot start"):
        return "the service cannot start (see its log)"
    if opening == "starting":
        return "the service is starting"
    return f"the service is starting: {failed}"


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **ERROR_RESPONSES},
    dependencies=[allowed("operate")],
)
async def metrics(request: Request, who: PrincipalDep) -> Response:
    """Prometheus metrics. Admin; a key scoped to some namespaces sees their series
    only (and the server's own, which name no namespace)."""
    data = generate_latest(scoped(request.app.state.metrics.registry, who))
    return Response(data, media_type=CONTENT_TYPE_LATEST)


class _Scoped(Collector):
    """A registry's metrics without the samples of namespaces `shown` refuses."""

    def __init__(self, registry: CollectorRegistry, shown: Callable[[str], bool]) -> None:
        self._registry = registry
        self._shown = shown

    def collect(self) -> Iterator[Metric]:
        for family in self._registry.collect():
            kept = Metric(family.name, family.documentation, family.type, family.unit)
            kept.samples = [
                s
                for s in family.samples
                if "namespace" not in s.labels or self._shown(s.labels["namespace"])
            ]
            yield kept


def scoped(registry: CollectorRegistry, who: Principal) -> CollectorRegistry:
    """`registry` as `who` may see it: whole for a key of every namespace."""
    if "*" in who.namespaces:
        return registry
    view = CollectorRegistry(auto_describe=False)
    view.register(_Scoped(registry, lambda namespace: who.may("operate", namespace)))
    return view
