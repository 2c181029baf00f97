"""Dependencies named as types: routes read `at: NamespaceDep, who: PrincipalDep`; a
route's right is declared with `dependencies=[allowed("write")]` (checked against the
`namespace` path parameter, when the route has one, declared as `NamespacePath`:
`NamespaceDep` takes it with the engine and the request's deadline).

Each is `async`: FastAPI runs a plain function dependency in a worker thread, a hop
that cost more than everything a small request does besides. None of them blocks; the
key ring's read of the catalog's keys, when one is due, goes to a worker thread."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

from fastapi import Depends, Path, Request, Security
from fastapi.security import APIKeyHeader, HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool

from r3store.engine import Engine
from r3store.errors import StoreError
from r3store.protocol.models import NAME_PATTERN
from r3store_server.auth import KeyRing, Principal
from r3store_server.limits import Deadline, MemoryBudget
from r3store_server.metrics import Metrics
from r3store_server.settings import Settings

T = TypeVar("T")


async def get_engine(request: Request) -> Engine:
    """The engine; 503 (`StoreError`, saying why) while it is still opening."""
    engine: Engine | None = request.app.state.engine
    if engine is None:
        raise StoreError(f"the service is {request.app.state.opening}")
    return engine


def _from_state(name: str, kind: type[T]) -> Callable[[Request], Awaitable[T]]:
    """The dependency that reads the application's `name`, a `kind` (`create_app` sets it)."""

    async def get(request: Request) -> T:
        value: T = getattr(request.app.state, name)
        return value

    return get


get_settings = _from_state("settings", Settings)
get_metrics = _from_state("metrics", Metrics)
get_keyring = _from_state("keyring", KeyRing)
get_budget = _from_state("budget", MemoryBudget)


async def get_deadline(request: Request) -> Deadline:
    """The request's deadline, counted from when its handler starts."""
    return Deadline((await get_settings(request)).request_timeout)


# The two ways to send a key, declared so that the OpenAPI schema states them (and
# Swagger UI's "Authorize" sends them); a missing key is the key ring's to judge.
API_KEY = APIKeyHeader(name="X-API-Key", auto_error=False, description="an r3store API key")
BEARER = HTTPBearer(auto_error=False, description="an r3store API key as a bearer token")


async def get_principal(
    request: Request,
    key: Annotated[str | None, Security(API_KEY)],
    bearer: Annotated[HTTPAuthorizationCredentials | None, Security(BEARER)],
) -> Principal:
    presented = key if key is not None else bearer.credentials if bearer else None
    keys = await get_keyring(request)
    if keys.fresh:  # judged with the keys known now: nothing to read
        return keys.authenticate(presented, client_address(request), refresh=False)
    return await run_in_threadpool(keys.authenticate, presented, client_address(request))


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
NamespacePath = Path(pattern=NAME_PATTERN, description="the namespace")


@dataclass(frozen=True)
class NamespaceAt:
    """The namespace a request's path names, with the engine and the request's deadline
    to act on it: routes read `at: NamespaceDep` and `await at.run(at.engine.namespaces.get)`."""

    engine: Engine
    namespace: str
    deadline: Deadline

    async def run(self, call: Callable[..., T], *args: object, what: str = "the request") -> T:
        """`call(namespace, *args)` off the event loop, within the request's deadline."""
        return await self.deadline.run(call, self.namespace, *args, what=what)


async def namespace_at(
    engine: EngineDep, deadline: DeadlineDep, namespace: str = NamespacePath
) -> NamespaceAt:
    return NamespaceAt(engine, namespace, deadline)


NamespaceDep = Annotated[NamespaceAt, Depends(namespace_at)]


def allowed(action: str) -> Any:
    """The dependency that lets a request through only if its key may `action` (on the
    route's `namespace`, if any): 401 without a key, 403 without the right."""

    async def check(request: Request, keys: KeyRingDep, who: PrincipalDep) -> None:
        keys.authorize(who, action, request.path_params.get("namespace"))

    return Depends(check)
