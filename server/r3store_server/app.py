"""The FastAPI application factory: `create_app(settings) -> FastAPI`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

import r3store
from r3store.engine import Engine
from r3store.engine.maintenance import Maintenance, MaintenanceOptions
from r3store.errors import StoreError
from r3store.policy import NamespaceSettings, Retention
from r3store.protocol import models
from r3store_server import (
    api_leases,
    api_namespaces,
    api_routes,
    api_stats,
    api_writes,
    apidocs,
    errors,
    openapi,
    operations,
    ui,
)
from r3store_server.auth import KeyRing
from r3store_server.backends import open_engine, server_lock
from r3store_server.limits import JSON_BODY_BYTES, BodyGuard, MemoryBudget
from r3store_server.metrics import Metrics
from r3store_server.observe import Observe
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


async def _opened(app: FastAPI, settings: Settings) -> Engine:
    """Open the engine, retrying with a bounded back-off (1 s doubling to 30 s) while the
    catalog or the store is unavailable (a database restarting); `/readyz` says why
    meanwhile. Any other error (a setting that cannot work) is not retried."""
    delay = 1.0
    while True:
        try:
            engine = await run_in_threadpool(open_engine, settings, True)
        except StoreError as exc:
            app.state.opening = f"starting: {exc}; retrying in {delay:.0f} s"
            log.warning("cannot open the store or the catalog (retrying in %.0f s): %s", delay, exc)
        else:
            app.state.owned = engine  # closed at shutdown, even if cancelled from here on
            return engine
        await asyncio.sleep(delay)
        delay = min(delay * 2, 30.0)


def _fatal(app: FastAPI, exc: BaseException) -> None:
    """A start that cannot succeed, found after the server began to listen: said, and
    the server stopped (`r3store-server` then exits with status 3)."""
    app.state.opening = f"cannot start: {exc}"
    app.state.fatal = str(exc)
    log.error("cannot start: %s", exc)
    stop = getattr(app.state, "stop", None)  # set by `r3store-server`'s uvicorn
    if stop is not None:
        stop()
    else:
        os.kill(os.getpid(), signal.SIGTERM)


def _log_start(settings: Settings, keyring: KeyRing, engine: Engine) -> None:
    """Say what the service serves from, and how it lets keys in."""
    log.info("r3store serving on %s", engine.store_description)
    log.info("catalog: %s", settings.catalog_description())
    if not keyring.enabled:
        log.warning("authentication is OFF (embedded store on a loopback address)")
    elif settings.ui_secret is None and not settings.loopback_only():
        log.warning(
            "R3STORE_UI_SECRET is not set: status-page sessions end when this server "
            "restarts and do not carry over to other replicas"
        )


def _attach(app: FastAPI, settings: Settings, keyring: KeyRing, engine: Engine) -> None:
    """Bind an open engine: the key ring reads its keys, the metrics watch it, its
    maintenance is made; from then on requests reach it."""
    keyring.attach(lambda: engine.keys.all(active_only=True))
    metrics: Metrics = app.state.metrics
    metrics.watch(engine)
    metrics.watch_namespaces(engine, settings.metrics_interval)
    _log_start(settings, keyring, engine)
    maintenance = app.state.maintenance = engine.upkeep.maintenance(
        MaintenanceOptions(
            grace_seconds=settings.maintenance_grace,
            orphan_seconds=settings.maintenance_orphan_age,
            cold_seconds=settings.maintenance_cold_age,
            rest_level=settings.maintenance_rest_level,
        )
    )
    metrics.watch_maintenance(maintenance)
    app.state.engine = engine
    app.state.opening = None


async def _run(
    app: FastAPI,
    settings: Settings,
    keyring: KeyRing,
    opening: asyncio.Task[Engine] | None,
    engine: Engine | None,
) -> None:
    """Wait for the engine if it is still opening (then attach it), and run
    maintenance."""
    if engine is None:
        assert opening is not None
        try:
            engine = await opening
            _attach(app, settings, keyring, engine)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - whatever it is, the start failed
            _fatal(app, exc)
            return
    if settings.maintenance_interval > 0:
        await _maintain(app.state.maintenance, settings.maintenance_interval)


async def _first_open(
    app: FastAPI, settings: Settings
) -> tuple[Engine | None, asyncio.Task[Engine] | None]:
    """The engine, opened at once; or, while the catalog or the store is not there yet,
    the task that keeps trying. A setting that cannot work raises: the start stops."""
    try:
        engine = app.state.owned = await run_in_threadpool(open_engine, settings, True)
    except StoreError as exc:
        log.warning("cannot open the store or the catalog yet: %s", exc)
        app.state.opening = f"starting: {exc}"
        return None, asyncio.create_task(_opened(app, settings))
    return engine, None


async def _close_owned(app: FastAPI) -> None:
    """Close the engine the service opened (not one it was given)."""
    if app.state.owned is not None:
        await run_in_threadpool(app.state.owned.close)


async def _stop(app: FastAPI, tasks: list[asyncio.Task[Any]]) -> None:
    """Cancel the lifespan's tasks, then stop the metrics and close the engine."""
    for pending in tasks:
        pending.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)  # said by `_run`
    await run_in_threadpool(app.state.metrics.close)  # before the engine closes
    await _close_owned(app)


def _lifespan(
    settings: Settings, keyring: KeyRing, engine: Engine | None
) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The service's lifespan: opens and binds the engine (unless given one), runs
    maintenance, and closes what it opened."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.engine = None
        app.state.owned = None
        app.state.fatal = None
        app.state.opening = "starting"
        with contextlib.ExitStack() as held:
            opening = None
            eng = engine
            if eng is None:
                held.enter_context(server_lock(settings))
                # the first try at once: a setting that cannot work stops the start
                eng, opening = await _first_open(app, settings)
            if eng is not None:  # open at once: whatever attaching raises stops the start
                try:
                    _attach(app, settings, keyring, eng)
                except BaseException:
                    await _close_owned(app)
                    raise
            task = asyncio.create_task(_run(app, settings, keyring, opening, eng))
            try:
                yield
            finally:
                await _stop(app, [t for t in (task, opening) if t is not None])

    return lifespan


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the service; the engine is made from `settings` unless one is given.

    Refuses (ValueError) to build a service without API keys anywhere but the embedded
    store on a loopback address. Until its engine is open (a catalog still starting)
    the service answers 503 and `/readyz` says why.
    """
    keyring = KeyRing.from_settings(settings)
    app = FastAPI(
        title="r3store",
        version=r3store.__version__,
        summary="A routing replay buffer for MoE reinforcement learning",
        lifespan=_lifespan(settings, keyring, engine),
        docs_url=None,  # served from the package's files by apidocs
        redoc_url=None,  # open: /healthz, /readyz, /openapi.json and /docs only
        swagger_ui_oauth2_redirect_url=None,
    )
    openapi.install(app, SCHEMA_MODELS)
    apidocs.install(app)
    app.state.settings = settings
    app.state.keyring = keyring
    app.state.metrics = Metrics()
    app.state.budget = MemoryBudget(
        settings.upload_memory_bytes, per_key=settings.upload_memory_key_bytes
    )
    app.state.metrics.watch_budget(app.state.budget)
    errors.install(app)
    app.add_middleware(
        BodyGuard,
        keyring=keyring,
        is_upload=api_routes.is_upload,
        limit=JSON_BODY_BYTES,
        grace=settings.body_timeout,
        rate=settings.body_min_rate,
    )
    app.add_middleware(Observe)
    routers = (operations, api_namespaces, api_routes, api_writes, api_leases, api_stats, ui)
    for router in (module.router for module in routers):
        app.include_router(router)
    return app
