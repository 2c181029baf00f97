"""Dependencies named as types: routes read `engine: EngineDep, who: PrincipalDep`; a
route's right is declared with `dependencies=[allowed("write")]` (checked against the
`namespace` path parameter, when the route has one)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer

from r3store.engine import Engine
from r3store.errors import StoreError
from r3store_server.auth import KeyRing, Principal
from r3store_server.limits import Deadline, MemoryBudget
from r3store_server.metrics import Metrics
from r3store_server.settings import Settings


def get_engine(request: Request) -> Engine:
    """The engine; 503 (`StoreError`, saying why) while it is still opening."""
    engine: Engine | None = request.app.state.engine
    if engine is None:
        raise StoreError(f"the service is {request.app.state.opening}")
    return engine


def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_metrics(request: Request) -> Metrics:
    metrics: Metrics = request.app.state.metrics
    return metrics


def get_keyring(request: Request) -> KeyRing:
    keyring: KeyRing = request.app.state.keyring
    return keyring


def get_budget(request: Request) -> MemoryBudget:
    budget: MemoryBudget = request.app.state.budget
    return budget


async def get_deadline(request: Request) -> Deadline:
    """The request's deadline, counted from when its handler starts."""
    return Deadline(get_settings(request).request_timeout)


# The two ways to send a key, declared so that the OpenAPI schema states them (and
# Swagger UI's "Authorize" sends them); a missing key is the key ring's to judge.
API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False, description="an r3store API key")
BEARER = HTTPBearer(auto_error=False, description="an r3store API key as a bearer token")


def get_principal(
    request: Request,
    key: Annotated[str | None, Security(API_KEY)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
) -> Principal:
    presented = key if key is not None else bearer.credentials if bearer else None
    return get_keyring(request).authenticate(presented, client_address(request))


def client_address(request: Request) -> str | None:
    """The client's address (uvicorn takes it from X-Forwarded-For when the peer is a
    trusted proxy), for counting its unknown keys."""
    return request.client.host if request.client is not None else None


EngineDep = Annotated[Engine, Depends(get_engine)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
MetricsDep = Annotated[Metrics, Depends(get_metrics)]
KeyRingDep = Annotated[KeyRing, Depends(get_keyring)]
PrincipalDep = Annotated[Principal, Depends(get_principal)]
BudgetDep = Annotated[MemoryBudget, Depends(get_budget)]
DeadlineDep = Annotated[Deadline, Depends(get_deadline)]


def allowed(action: str) -> Any:
    """The dependency that lets a request through only if its key may `action` (on the
    route's `namespace`, if any): 401 without a key, 403 without the right."""

    def check(request: Request, keys: KeyRingDep, who: PrincipalDep) -> None:
        keys.authorize(who, action, request.path_params.get("namespace"))

    return Depends(check)
