"""The data plane: rollout workers upload trajectories, trainers read and sample routes.

Bodies are Arrow IPC streams (`r3store.protocol.wire`, docs/api.md); JSON only for requests and
acknowledgements.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import StreamingResponse

from r3store.catalog_types import TrajectoryEntry
from r3store.engine import put_row_bytes
from r3store.errors import InvalidInput, PayloadTooLarge, StoreError, UnsupportedMediaType
from r3store.logic.streams import decoded_bytes
from r3store.protocol.models import (
    NAME_PATTERN,
    BatchRequest,
    PlanRequest,
    PutItem,
    PutResponse,
    ReadPlanModel,
    SampleRequest,
)
from r3store.protocol.wire import (
    CONTENT_TYPE,
    STREAM_END,
    ReadFormat,
    answer_bytes,
    decode_writes,
    encode_chunks,
)
from r3store.records import Batch
from r3store.spec import RouteSpec
from r3store_server.answer_memory import AnswerCharge, ChargedAnswer, answer_cost
from r3store_server.deps import (
    BudgetDep,
    MetricsDep,
    NamespaceAt,
    NamespaceDep,
    PrincipalDep,
    SettingsDep,
    allowed,
)
from r3store_server.errors import ERROR_RESPONSES
from r3store_server.limits import Deadline, MemoryBudget, Reservation
from r3store_server.metrics import Metrics
from r3store_server.settings import UPLOAD_COST

router = APIRouter(prefix="/v1/namespaces", tags=["routes"], responses=ERROR_RESPONSES)
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


UPLOAD_PATH = re.compile(
    re.escape(router.prefix) + "/" + NAME_PATTERN.strip("^$") + "/trajectories", re.ASCII
)


def is_upload(method: str, path: str) -> bool:
    """Whether this is the upload route, exactly (its body has its own, larger limit;
    every other body the small one of `limits.BodyGuard`)."""
    return method == "POST" and UPLOAD_PATH.fullmatch(path) is not None


async def read_body(
    request: Request, limit: int, budget: MemoryBudget, wait: float, key: str = ""
) -> tuple[bytearray, Reservation]:
    """The request body and its memory reservation (held for `key`): refused past
    `limit` bytes (413), or when the upload budget (or `key`'s share of it) has no room
    for it within `wait` seconds (429), before it is read."""
    media = request.headers.get("content-type", "").split(";")[0].strip()
    if media != CONTENT_TYPE:
        raise UnsupportedMediaType(f"send the trajectories as {CONTENT_TYPE}, not {media!r}")
    header = request.headers.get("content-length")
    declared = int(header) if header is not None and header.isdigit() else None
    if declared is not None and declared > limit:
        raise PayloadTooLarge(f"the body has {declared} bytes; the limit is {limit}")
    reservation = await budget.admit(UPLOAD_COST * (declared or 0), wait, key)
    try:
        body = bytearray(declared or 0)
        size = 0
        async for chunk in request.stream():
            if size + len(chunk) > limit:
                raise PayloadTooLarge(f"the body exceeds the limit of {limit} bytes")
            if declared is None:
                reservation.grow(UPLOAD_COST * len(chunk))
                body += chunk
            elif size + len(chunk) > declared:
                raise InvalidInput(f"the body is longer than its Content-Length ({declared})")
            else:
                body[size : size + len(chunk)] = chunk
            size += len(chunk)
        if declared is not None and size != declared:
            raise InvalidInput(f"the body has {size} bytes, not its Content-Length ({declared})")
    except BaseException:
        reservation.release()
        raise
    return body, reservation


@router.post(
    "/{namespace}/trajectories",
    response_model=PutResponse,
    openapi_extra=UPLOAD_BODY,
    responses={413: ERROR_RESPONSES[400], 415: ERROR_RESPONSES[400], 429: ERROR_RESPONSES[400]},
    dependencies=[allowed("write")],
)
async def upload(
    request: Request,
    at: NamespaceDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    budget: BudgetDep,
    who: PrincipalDep,
) -> PutResponse:
    """Store trajectories (or appended segments); answers after the durable commit.

    All rows of one request are stored, or none. A retry of stored content is
    acknowledged with `created: false`; other content under a stored id is a 409. A
    full write buffer, or uploads in flight past the memory budget, answer 429 with
    Retry-After; a slow store answers 503 with Retry-After (the upload may still land:
    retry it). Writer or admin.
    """
    spec = await at.run(at.engine.namespaces.spec)
    body, reservation = await at.deadline.wait(
        read_body(request, settings.max_body_bytes, budget, settings.request_timeout / 2, who.name),
        "reading the body",
    )
    metrics.bytes_in.inc(len(body))

    def admit(rows: int, checking: int) -> None:
        charge_rows(rows, spec, budget, reservation, checking)

    def store(namespace: str) -> PutResponse:
        writes = decode_writes(body, spec, settings.max_upload_rows, admit)
        token_layers = sum(w.num_tokens for w in writes) * spec.num_layers
        others = who.may("annotate", namespace)  # another key's trajectories too
        stop = at.deadline.cancelled.is_set
        encoded = at.engine.encode(
            namespace, writes, writer=who.name, annotate_any=others, stop=stop
        )
        del writes  # nothing refers to the body any more: its memory goes before the commit
        with contextlib.suppress(BufferError):
            body.clear()
        if stop():  # answered meanwhile (503): store nothing
            raise StoreError("the upload was answered before it was committed")
        started = time.perf_counter()
        results = at.engine.commit(encoded)
        metrics.commit.observe(time.perf_counter() - started)
        metrics.token_layers_in.inc(token_layers)
        return PutResponse(results=[PutItem.of(r) for r in results])

    return await at.deadline.run(store, at.namespace, what="the upload", reservation=reservation)


def charge_rows(
    rows: int,
    spec: RouteSpec,
    budget: MemoryBudget,
    reservation: Reservation,
    checking: int = 0,
) -> None:
    """Hold what `rows` rows of an upload take from decoding to the commit, beyond their
    body (`put_row_bytes`: each row's `[L, E]` expert-load counts and its records), and
    `checking`, what checking its largest encoded segment holds
    (`streams.checking_bytes`: a small body can decompress to 64 MiB a segment), before
    any row is decoded: 413 when the budget could never hold it, 429 when uploads in
    flight hold the room now."""
    per_row = put_row_bytes(spec)
    need = rows * per_row + checking
    most = min(budget.limit, budget.per_key)  # what one upload can ever hold
    if reservation.nbytes + need > most:
        fit = max(0, (most - reservation.nbytes - checking) // per_row)
        raise PayloadTooLarge(
            f"{rows} rows of a namespace of {spec.num_layers} layers and {spec.num_experts} "
            f"experts hold {need} bytes while they are checked and stored ({per_row} a "
            f"row, {checking} to check the largest encoded segment), besides the "
            f"{reservation.nbytes} of the body: more than one upload may hold of the "
            f"upload memory (R3STORE_UPLOAD_MEMORY_BYTES, R3STORE_UPLOAD_MEMORY_PER_KEY: "
            f"{most} bytes); send at most {fit} rows per upload of this size, or shorter "
            "segments"
        )
    reservation.grow(need)


def read_limit(
    spec: RouteSpec,
    fmt: ReadFormat,
    limit: int,
    asked: int,
    some_layers: bool = False,
    charge: AnswerCharge | None = None,
) -> Callable[[list[TrajectoryEntry]], None]:
    """The `admit` of a read or a sample: refuses (413) an answer whose routes in `fmt`
    would exceed `limit` bytes (`wire.answer_bytes`, from the catalog before anything is
    read), saying how many of the `asked` ids would fit. A read of `some_layers` decodes
    every segment whole to cut its layers: what it decodes counts too. An answer that
    fits holds its cost from the memory budget (`charge`; 429 without room)."""

    def admit(segments: list[TrajectoryEntry]) -> None:
        size = answer_bytes(spec, fmt, segments)
        if some_layers:
            size += sum(decoded_bytes(spec, s.num_tokens) for s in segments)
        if size <= limit:
            if charge is not None:
                charge.hold(answer_cost(spec, fmt, segments, some_layers))
            return
        trajectories = len({s.trajectory_id for s in segments}) or 1
        fit = max(1, asked * limit // size) if trajectories > 1 else 0
        split = (
            f"ask for at most about {fit} of the {asked} ids at a time"
            if fit
            else "this trajectory alone is larger"
        )
        raise PayloadTooLarge(
            f"the answer would hold {size} bytes of routes as {fmt}"
            f"{' with the routes decoded to cut its layers' if some_layers else ''} for "
            f"{trajectories} trajectories; the limit is {limit} bytes "
            f"(R3STORE_MAX_READ_BYTES): {split}, or read format encoded (the stored "
            "streams) or a direct read (routes/plan)"
        )

    return admit


def _answer(
    batch: Batch,
    spec: RouteSpec,
    fmt: ReadFormat,
    metrics: Any,
    deadline: Deadline,
    layers: list[int] | None = None,
) -> Response:
    """The answer of a read: whole when it is one piece (`encode_chunks`), else its
    first piece made here, within the request's deadline (so that what fails early is
    answered with its status), and the others streamed, each made only once the one
    before was handed to the connection: a client that reads slowly holds a piece or
    two (`answer_memory`), and one that reads slower than `R3STORE_SEND_MIN_RATE` is
    dropped."""
    streaming = threading.Event()  # from then on, only a client gone stops the pieces

    def stop() -> bool:
        return not streaming.is_set() and deadline.cancelled.is_set()

    pieces = encode_chunks(batch, spec, fmt, stop, layers)
    head = list(itertools.islice(pieces, 3))  # the schema, rows (or the end), the end?
    metrics.token_layers_out.inc(
        sum(item.num_tokens for item in batch.items if item is not None)
        * (spec.num_layers if layers is None else len(layers))
    )
    if head[-1] == STREAM_END:  # one piece of rows, or none: the answer whole
        data = b"".join(head)
        metrics.bytes_out.inc(len(data))
        return Response(content=data, media_type=CONTENT_TYPE)
    streaming.set()

    def sent() -> Iterator[bytes | memoryview]:
        while head:  # each piece let go once handed over
            piece = head.pop(0)
            metrics.bytes_out.inc(len(piece))
            yield piece
        for piece in pieces:
            metrics.bytes_out.inc(len(piece))
            yield piece

    return StreamingResponse(sent(), media_type=CONTENT_TYPE)


async def _charged(
    at: NamespaceAt, make: Callable[[str], Response], charge: AnswerCharge, what: str
) -> Response:
    """The answer `make` makes of the namespace within the request's deadline, holding
    `charge` (taken by its `read_limit`) until it has been sent; given back at once if
    it fails."""
    try:
        answer = await at.run(make, what=what)
    except BaseException:
        charge.release()
        raise
    return ChargedAnswer(answer, charge)


@dataclass(frozen=True)
class Answering:
    """What a read's Arrow answer takes: the bytes of routes it may hold
    (`R3STORE_MAX_READ_BYTES`), the metrics that count it, and its charge on the key's
    share of the memory budget."""

    max_bytes: int
    metrics: Metrics
    charge: AnswerCharge


async def answering(
    settings: SettingsDep, metrics: MetricsDep, budget: BudgetDep, who: PrincipalDep
) -> Answering:
    return Answering(settings.max_read_bytes, metrics, AnswerCharge(budget, who.name))


AnsweringDep = Annotated[Answering, Depends(answering)]


@router.post(
    "/{namespace}/routes/batch",
    response_class=Response,
    responses=ARROW,
    dependencies=[allowed("read")],
)
async def read_batch(body: BatchRequest, at: NamespaceDep, answer: AnsweringDep) -> Response:
    """The routes of the trajectories a trainer rank holds, in the order asked.

    Missing and stale ids are named in the stream's metadata, never dropped silently.
    Each trajectory comes from one route source (its rows' `source` column): `source`
    if given, else the first of the namespace's `read_sources` it holds. `layers`: only
    those layers' routes (a pipeline stage's), the answer's spec narrowed to them and
    its metadata naming them. While it is sent the answer holds memory from the budget
    uploads share (429 with Retry-After when there is no room). Reader or admin.
    """

    def fetch(namespace: str) -> Response:
        spec = at.engine.namespaces.spec(namespace)
        if body.layers is not None:
            spec.check_layers(body.layers)  # refused before anything is read
        batch = at.engine.get_batch(
            namespace,
            body.ids,
            decode=False,
            include_stale=body.include_stale,
            source=body.source,
            admit=read_limit(
                spec,
                body.format,
                answer.max_bytes,
                len(body.ids),
                some_layers=body.layers is not None,
                charge=answer.charge,
            ),
            as_stored=True,  # each row decoded once, by encode_batch
        )
        return _answer(batch, spec, body.format, answer.metrics, at.deadline, body.layers)

    return await _charged(at, fetch, answer.charge, "the read")


@router.post("/{namespace}/routes/plan", dependencies=[allowed("read")])
async def read_plan(body: PlanRequest, at: NamespaceDep, settings: SettingsDep) -> ReadPlanModel:
    """A direct read: where the routes of `ids` lie in the object store, with presigned
    URLs valid for `expires` seconds (at most the maintenance grace, so a compacted
    shard outlives its URLs). The client fetches the byte ranges itself; the server
    only looks them up. Needs an S3 store (400 on the embedded one). Reader or admin."""
    expires = body.expires
    if settings.maintenance_grace > 0:
        expires = max(1, min(expires, int(settings.maintenance_grace)))

    def plan(namespace: str) -> ReadPlanModel:
        found = at.engine.read_plan(namespace, body.ids, expires, body.include_stale, body.source)
        return ReadPlanModel.of(found)

    return await at.run(plan, what="the read plan")


@router.post(
    "/{namespace}/routes/sample",
    response_class=Response,
    responses=ARROW,
    dependencies=[allowed("read")],
)
async def sample(
    body: SampleRequest, at: NamespaceDep, who: PrincipalDep, answer: AnsweringDep
) -> Response:
    """Take up to `n` trajectories within the staleness window (FIFO or uniform,
    optionally whole prompt groups) and held by no open lease; each counts toward
    `max_times_sampled` at once (a lease committed as taken: take a lease instead to
    count only after the step). Not idempotent: a failed sample may have counted (the
    client does not retry it; a sample answered 429, its answer's memory not free, counted
    nothing). Reader or admin."""

    def take(namespace: str) -> Response:
        spec = at.engine.namespaces.spec(namespace)
        batch = at.engine.sample(
            namespace,
            body.n,
            body.strategy,
            body.whole_groups,
            decode=False,
            seed=body.seed,
            admit=read_limit(spec, body.format, answer.max_bytes, body.n, charge=answer.charge),
            as_stored=True,
            holder=who.name,
        )
        return _answer(batch, spec, body.format, answer.metrics, at.deadline)

    return await _charged(at, take, answer.charge, "the sample")
