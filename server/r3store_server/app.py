"""The FastAPI application factory."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool

from r3store.catalog import Catalog
from r3store.engine import Engine
from r3store.errors import R3StoreError
from r3store.store import LocalStore, ObjectStore, S3Config, S3Store
from r3store_server.settings import Settings

log = logging.getLogger("r3store.server")


def build_store(settings: Settings) -> ObjectStore:
    if settings.embedded:
        return LocalStore(settings.data_dir / "objects")
    s3 = settings.s3
    return S3Store(
        S3Config(
            bucket=s3.bucket,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            access_key_id=s3.access_key_id.get_secret_value() if s3.access_key_id else None,
            secret_access_key=(
                s3.secret_access_key.get_secret_value() if s3.secret_access_key else None
            ),
            prefix=s3.prefix,
        )
    )


def build_engine(settings: Settings) -> Engine:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return Engine(build_store(settings), Catalog(settings.resolved_catalog_url()))


def create_app(settings: Settings, engine: Engine | None = None) -> FastAPI:
    """Build the service; the engine is made from `settings` unless one is given."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        own = engine is None
        app.state.engine = engine if engine is not None else build_engine(settings)
        store = app.state.engine.store
        mode = "embedded store" if settings.embedded else "S3 store"
        log.info("r3store serving on the %s: %s", mode, store.description)
        log.info("catalog: %s", settings.resolved_catalog_url().split("@")[-1])
        try:
            yield
        finally:
            if own:
                await run_in_threadpool(app.state.engine.close)

    app = FastAPI(title="r3store", version="0.1.0", lifespan=lifespan)
    app.state.settings = settings

    @app.get("/healthz", tags=["operations"])
    async def healthz() -> dict[str, str]:
        """The process is up."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["operations"], response_model=None)
    async def readyz() -> dict[str, str] | JSONResponse:
        """The object store and the catalog answer."""
        eng: Engine = app.state.engine
        try:
            await run_in_threadpool(eng.store.ping)
            await run_in_threadpool(eng.catalog.ping)
        except R3StoreError as exc:
            return JSONResponse({"status": "unavailable", "detail": str(exc)}, status_code=503)
        return {"status": "ready"}

    return app
