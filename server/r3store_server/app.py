"""The FastAPI application factory: `create_app(settings) -> FastAPI`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

import r3store
from r3store import models
from r3store.engine import Engine
from r3store.maintenance import Maintenance
from r3store.policy import NamespaceSettings, Retention
from r3store_server import (
    api_namespaces,
    api_routes,
    api_stats,
    apidocs,
    errors,
    openapi,
    operations,
    ui,
)
from r3store_server.auth import KeyRing
from r3store_server.backends import build_engine
from r3store_server.limits import JSON_BODY_BYTES, JsonBodyLimit, MemoryBudget
from r3store_server.metrics import Metrics
from r3store_server.observe import observe
from r3store_server.settings import Settings

log = logging.getLogger("r3store.server")
SCHEMA_MODELS = [
    *(getattr(models, name) for name in models.__all__),
    NamespaceSettings,
    Retention,
]


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
        eng = app.state.engine = engine if engine is not None else build_engine(settings)
        keyring.attach(lambda: eng.list_keys(active_only=True))
        app.state.metrics.watch(eng)
        app.state.metrics.watch_namespaces(eng)
        log.info("r3store serving on %s", eng.store_description)
        log.info("catalog: %s", settings.catalog_description())
        if not keyring.enabled:
            log.warning("authentication is OFF (embedded store on a loopback address)")
        maintenance = app.state.maintenance = eng.maintenance(
            grace_seconds=settings.maintenance_grace,
            orphan_seconds=settings.maintenance_orphan_age,
            cold_seconds=settings.maintenance_cold_age,
            rest_level=settings.maintenance_rest_level,
        )
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
                await run_in_threadpool(eng.close)

    app = FastAPI(
        title="r3store",
        version=r3store.__version__,
        summary="A routing replay buffer for MoE reinforcement learning",
        lifespan=lifespan,
        docs_url=None,  # served from the package's files by apidocs
        redoc_url=None,  # open: /healthz, /readyz, /openapi.json and /docs only
        swagger_ui_oauth2_redirect_url=None,
    )
    openapi.install(app, SCHEMA_MODELS)
    apidocs.install(app)
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = Metrics()
    app.state.budget = MemoryBudget(settings.upload_memory_bytes)
    errors.install(app)
    app.add_middleware(JsonBodyLimit, is_upload=api_routes.is_upload, limit=JSON_BODY_BYTES)
    app.middleware("http")(observe)
    routers = (operations, api_namespaces, api_routes, api_stats, ui)
    for router in (module.router for module in routers):
        app.include_router(router)
    return app
