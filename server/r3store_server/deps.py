"""Dependencies named as types: routes read `engine: EngineDep, who: PrincipalDep`; a
route's right is declared with `dependencies=[allowed("write")]` (checked against the
`namespace` path parameter, when the route has one)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Request

from r3store.engine import Engine
from r3store_server.auth import KeyRing, Principal
from r3store_server.limits import Deadline, MemoryBudget
from r3store_server.metrics import Metrics
from r3store_server.settings import Settings


def get_engine(request: Request) -> Engine:
    engine: Engine = request.app.state.engine
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


def get_principal(request: Request) -> Principal:
    keyring = get_keyring(request)
    presented = request.headers.get("x-api-key")
    header = request.headers.get("authorization", "")
    if presented is None and header.lower().startswith("bearer "):
        presented = header[7:].strip()
    return keyring.authenticate(presented)


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
