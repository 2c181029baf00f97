"""The FastAPI application factory: `create_app(settings) -> FastAPI`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.concurrency import run_in_threadpool

from r3store import models
from r3store.catalog import Catalog
from r3store.engine import Engine
from r3store.errors import R3StoreError
from r3store.maintenance import Maintenance
from r3store.models import Health
from r3store.policy import NamespaceSettings, Retention
from r3store.store import LocalStore, ObjectStore, S3Config, S3Store
from r3store_server import api_namespaces, api_routes, errors, openapi
from r3store_server.auth import KeyRing
from r3store_server.deps import KeyRingDep, PrincipalDep
from r3store_server.limits import JSON_BODY_BYTES, Deadline, JsonBodyLimit, MemoryBudget
from r3store_server.logs import request_id
from r3store_server.metrics import Metrics
from r3store_server.settings import Settings

log = logging.getLogger("r3store.server")
SCHEMA_MODELS = [
    *(getattr(models, name) for name in models.__all__),
    NamespaceSettings,
    Retention,
]


def build_store(settings: Settings) -> ObjectStore:
    if settings.embedded:
        return LocalStore(settings.data_dir / "objects")
    s3 = settings.s3
    key_id, secret = s3.credentials()
    return S3Store(
        S3Config(
            bucket=s3.bucket,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            access_key_id=key_id,
            secret_access_key=secret,
            prefix=s3.prefix,
            connect_timeout=s3.connect_timeout,
            read_timeout=s3.read_timeout,
            max_attempts=s3.max_attempts,
        )
    )


def build_engine(settings: Settings) -> Engine:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(settings.resolved_catalog_url(), timeout=settings.catalog_timeout)
    return Engine(build_store(settings), catalog)


async def _maintain(maintenance: Maintenance, interval: float) -> None:
    """Retention, compaction and collection every `interval` seconds, off the event loop."""
    while True:
        await asyncio.sleep(interval)
        try:
            report = await run_in_threadpool(maintenance.run)
            if report.trajectories_dropped or report.shards_compacted or report.objects_deleted:
                log.info("maintenance", extra={"fields": report.__dict__})
        except Exception:
            log.exception("maintenance pass failed")


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the service; the engine is made from `settings` unless one is given.

    Refuses (ValueError) to build a service without API keys anywhere but the embedded
    store on a loopback address.
    """
    keyring = KeyRing.from_settings(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        app.state.engine = engine if engine is not None else build_engine(settings)
        keyring.attach(lambda: app.state.engine.catalog.list_keys(active_only=True))
        app.state.metrics.watch(app.state.engine)
        store = app.state.engine.store
        mode = "the embedded store" if settings.embedded else "S3"
        log.info("r3store serving on %s: %s", mode, store.description)
        log.info("catalog: %s", settings.resolved_catalog_url().split("@")[-1])
        if not keyring.enabled:
            log.warning("authentication is OFF (embedded store on a loopback address)")
        maintenance = Maintenance(
            app.state.engine,
            grace_seconds=settings.maintenance_grace,
            orphan_seconds=settings.maintenance_orphan_age,
        )
        app.state.maintenance = maintenance
        app.state.metrics.watch_maintenance(maintenance)
        task = None
        if settings.maintenance_interval > 0:
            task = asyncio.create_task(_maintain(maintenance, settings.maintenance_interval))
        try:
            yield
        finally:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
            if own:
                await run_in_threadpool(app.state.engine.close)

    app = FastAPI(
        title="r3store",
        version="0.1.0",
        summary="A routing replay buffer for MoE reinforcement learning",
        lifespan=lifespan,
        redoc_url=None,  # open: /healthz, /readyz, /openapi.json and /docs only
        swagger_ui_oauth2_redirect_url=None,
    )
    openapi.install(app, SCHEMA_MODELS)
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = Metrics()
    app.state.budget = MemoryBudget(settings.upload_memory_bytes)
    errors.install(app)
    app.add_middleware(JsonBodyLimit, is_upload=api_routes.is_upload, limit=JSON_BODY_BYTES)
    app.include_router(api_namespaces.router)
    app.include_router(api_routes.router)

    @app.middleware("http")
    async def observe(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        rid = request.headers.get("x-request-id") or uuid.uuid4().hex
        token = request_id.set(rid[:64])
        started = time.perf_counter()
        response = await call_next(request)
        elapsed = time.perf_counter() - started
        route = request.scope.get("route")
        path = getattr(route, "path", "unmatched")
        metrics: Metrics = request.app.state.metrics
        metrics.requests.labels(path, request.method, response.status_code).inc()
        metrics.latency.labels(path).observe(elapsed)
        code = getattr(request.state, "error_code", None)
        if code:
            metrics.errors.labels(code).inc()
        response.headers["X-Request-ID"] = rid[:64]
        log.info(
            "request",
            extra={
                "fields": {
                    "method": request.method,
                    "path": request.url.path,
                    "status": response.status_code,
                    "ms": round(elapsed * 1000, 2),
                    **({"error": code} if code else {}),
                }
            },
        )
        request_id.reset(token)
        return response

    @app.get("/healthz", tags=["operations"], response_model=Health)
    async def healthz() -> Health:
        """The process is up. Open to all."""
        return Health(status="ok")

    @app.get(
        "/readyz",
        tags=["operations"],
        response_model=Health,
        responses={503: {"model": Health, "description": "store or catalog unreachable"}},
    )
    async def readyz(request: Request) -> Health | JSONResponse:
        """The object store and the catalog answer, within `R3STORE_READINESS_TIMEOUT`.
        Open to all."""
        eng: Engine = request.app.state.engine
        deadline = Deadline(settings.readiness_timeout)
        try:
            await deadline.run(eng.store.ping, what="the object store's readiness probe")
            await deadline.run(eng.catalog.ping, what="the catalog's readiness probe")
        except R3StoreError as exc:
            body = Health(status="unavailable", detail=str(exc))
            return JSONResponse(body.model_dump(), status_code=503)
        return Health(status="ready")

    @app.get(
        "/metrics",
        tags=["operations"],
        response_class=Response,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **errors.ERROR_RESPONSES,
        },
    )
    async def metrics(request: Request, keys: KeyRingDep, who: PrincipalDep) -> Response:
        """Prometheus metrics. Admin."""
        keys.authorize(who, "operate")
        data = generate_latest(request.app.state.metrics.registry)
        return Response(data, media_type=CONTENT_TYPE_LATEST)

    return app
