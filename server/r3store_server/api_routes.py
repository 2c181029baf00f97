"""The data plane: rollout workers upload trajectories, trainers read and sample routes.

Bodies are Arrow IPC streams (`r3store.wire`, docs/api.md); JSON only for requests and
acknowledgements.
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Path, Request, Response
from starlette.concurrency import run_in_threadpool

from r3store.engine import Engine
from r3store.errors import PayloadTooLarge, UnsupportedMediaType
from r3store.models import NAME_PATTERN, BatchRequest, PutItem, PutResponse, SampleRequest
from r3store.records import Batch
from r3store.spec import RouteSpec
from r3store.wire import CONTENT_TYPE, ReadFormat, decode_writes, encode_batch
from r3store_server.deps import EngineDep, KeyRingDep, MetricsDep, PrincipalDep, SettingsDep
from r3store_server.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/namespaces", tags=["routes"], responses=ERROR_RESPONSES)
NamespacePath = Path(pattern=NAME_PATTERN, description="the namespace")
ARROW: dict[int | str, dict[str, Any]] = {
    200: {
        "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "description": "an Arrow IPC stream, one row per stored segment (docs/api.md)",
    }
}
UPLOAD_BODY: dict[str, Any] = {
    "requestBody": {
        "required": True,
        "content": {CONTENT_TYPE: {"schema": {"type": "string", "format": "binary"}}},
        "description": "an Arrow IPC stream, one row per trajectory or segment (docs/api.md)",
    }
}


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused past `limit` bytes (413) before it is all read."""
    media = request.headers.get("content-type", "").split(";")[0].strip()
    if media != CONTENT_TYPE:
        raise UnsupportedMediaType(f"send the trajectories as {CONTENT_TYPE}, not {media!r}")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise PayloadTooLarge(f"the body has {declared} bytes; the limit is {limit}")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@router.post(
    "/{namespace}/trajectories",
    response_model=PutResponse,
    openapi_extra=UPLOAD_BODY,
    responses={413: ERROR_RESPONSES[400], 415: ERROR_RESPONSES[400], 429: ERROR_RESPONSES[400]},
)
async def upload(
    request: Request,
    engine: EngineDep,
    keys: KeyRingDep,
    who: PrincipalDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    namespace: str = NamespacePath,
) -> PutResponse:
    """Store trajectories (or appended segments); answers after the durable commit.

    All rows of one request are stored, or none. A retry of stored content is
    acknowledged with `created: false`; other content under a stored id is a 409. A
    full write buffer answers 429 with Retry-After. Writer or admin.
    """
    keys.authorize(who, "write", namespace)
    body = await read_body(request, settings.max_body_bytes)
    metrics.bytes_in.inc(len(body))
    spec = await run_in_threadpool(engine.spec, namespace)

    def store() -> PutResponse:
        writes = decode_writes(body, spec)
        started = time.perf_counter()
        results = engine.put(namespace, writes)
        metrics.commit.observe(time.perf_counter() - started)
        metrics.token_layers_in.inc(sum(w.num_tokens for w in writes) * spec.num_layers)
        return PutResponse(results=[PutItem(**r.__dict__) for r in results])

    return await run_in_threadpool(store)


def _answer(batch: Batch, spec: RouteSpec, fmt: ReadFormat, metrics: Any) -> Response:
    data = encode_batch(batch, spec, fmt)
    metrics.bytes_out.inc(len(data))
    metrics.token_layers_out.inc(
        sum(item.num_tokens for item in batch.items if item is not None) * spec.num_layers
    )
    return Response(content=data, media_type=CONTENT_TYPE)


@router.post("/{namespace}/routes/batch", response_class=Response, responses=ARROW)
async def read_batch(
    body: BatchRequest,
    engine: EngineDep,
    keys: KeyRingDep,
    who: PrincipalDep,
    metrics: MetricsDep,
    namespace: str = NamespacePath,
) -> Response:
    """The routes of the trajectories a trainer rank holds, in the order asked.

    Missing and stale ids are named in the stream's metadata, never dropped silently.
    Reader or admin.
    """
    keys.authorize(who, "read", namespace)

    def fetch() -> Response:
        batch = engine.get_batch(
            namespace, body.ids, decode=False, include_stale=body.include_stale
        )
        return _answer(batch, engine.spec(namespace), body.format, metrics)

    return await run_in_threadpool(fetch)


@router.post("/{namespace}/routes/sample", response_class=Response, responses=ARROW)
async def sample(
    body: SampleRequest,
    engine: EngineDep,
    keys: KeyRingDep,
    who: PrincipalDep,
    metrics: MetricsDep,
    namespace: str = NamespacePath,
) -> Response:
    """Take up to `n` trajectories within the staleness window (FIFO or uniform,
    optionally whole prompt groups); each counts toward `max_times_sampled`. Reader
    or admin."""
    keys.authorize(who, "read", namespace)

    def take(eng: Engine) -> Response:
        batch = eng.sample(
            namespace, body.n, body.strategy, body.whole_groups, decode=False, seed=body.seed
        )
        return _answer(batch, eng.spec(namespace), body.format, metrics)

    return await run_in_threadpool(take, engine)
