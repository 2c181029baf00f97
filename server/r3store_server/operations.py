"""Health, readiness and metrics endpoints, for orchestrators and Prometheus."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from r3store.errors import R3StoreError
from r3store.models import Health
from r3store_server.deps import SettingsDep, allowed, get_engine
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
async def readyz(request: Request, settings: SettingsDep) -> Health | JSONResponse:
    """The object store and the catalog answer, within `R3STORE_READINESS_TIMEOUT`.
    Open to all."""
    try:
        engine = get_engine(request)
        await Deadline(settings.readiness_timeout).run(engine.ping, what="the readiness probe")
    except R3StoreError as exc:
        body = Health(status="unavailable", detail=str(exc))
        return JSONResponse(body.model_dump(), status_code=503)
    return Health(status="ready")


@router.get(
    "/metrics",
    response_class=Response,
    responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}}, **ERROR_RESPONSES},
    dependencies=[allowed("operate")],
)
async def metrics(request: Request) -> Response:
    """Prometheus metrics. Admin."""
    data = generate_latest(request.app.state.metrics.registry)
    return Response(data, media_type=CONTENT_TYPE_LATEST)
