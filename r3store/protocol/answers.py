"""The read answer format, server -> client: one Arrow IPC stream, a row per stored
segment, trajectories in the order asked, the routes as the stored streams or decoded
(`ReadFormat`), the spec, ids, missing and stale in the schema's metadata (docs/api.md
lists the columns). `answer_bytes` sizes an answer before anything is read,
`encode_batch` writes one, `decode_batch` reads one."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from r3store.errors import InvalidInput, StoreError
from r3store.logic import codec
from r3store.logic.routes import from_mask, to_mask
from r3store.policy import ENGINE
from r3store.protocol.formats import (
    WIRE_VERSION,
    ReadFormat,
)
from r3store.protocol.ipc import read_table
from r3store.records import (
    Batch,
    SegmentRead,
    TrajectoryRead,
    assemble,
    check_source,
)
from r3store.route_types import EncodedRoutes, Routes
from r3store.spec import RouteSpec
from r3store.transforms import TRANSFORMS, Transform


class _Span(Protocol):
    @property
    def length(self) -> int: ...


class _Spans(Protocol):
    @property
    def tokens(self) -> _Span | None: ...
    @property
    def spans(self) -> Sequence[_Span]: ...


class _Stored(Protocol):  # a catalog entry (`TrajectoryEntry`)
    @property
    def num_tokens(self) -> int: ...
    @property
    def spans(self) -> _Spans: ...


def answer_bytes(spec: RouteSpec, fmt: ReadFormat, segments: Sequence[_Stored]) -> int:
    """The route bytes an answer of `segments` in `fmt` holds, from the catalog's
    token counts and the spec alone, before anything is read or decoded: the stored
    streams for `encoded` (a shared prefix counted with each row that continues it);
    for `ids` and `mask` the decoded arrays (for `ids` with the counts), and the token
    ids when they are stored."""
    total = 0
    for s in segments:
        n, spans = s.num_tokens, s.spans
        if fmt is ReadFormat.ENCODED:
            total += sum(span.length for span in spans.spans)
            continue
        if fmt is ReadFormat.IDS:
            # and the counts (at most: a row continuing a shared prefix may take them there)
            total += n * spec.num_layers * (spec.top_k * spec.id_dtype.itemsize + 1)
        else:
            total += n * spec.num_layers * spec.mask_bytes
        total += 0 if spans.tokens is None else 4 * n
    return total


CHUNK_BYTES = 4 << 20  # route bytes of one record batch of an answer sent in pieces
STREAM_END = b"\xff\xff\xff\xff\x00\x00\x00\x00"  # an Arrow IPC stream's end, its last piece
COLUMNS = pa.schema(
    [
        ("trajectory_id", pa.string()),
        ("start", pa.int64()),
        ("num_tokens", pa.int64()),
        ("policy_version", pa.int64()),
        ("group_id", pa.string()),
        ("prompt_len", pa.int64()),
        ("route_transform", pa.int8()),
        ("route_ids", pa.large_binary()),
        ("route_counts", pa.large_binary()),
        ("route_order", pa.large_binary()),
        ("token_ids", pa.large_binary()),
        ("source", pa.string()),
        ("digest", pa.binary()),
    ]
)


def encode_batch(
    batch: Batch,
    spec: RouteSpec,
    fmt: ReadFormat,
    stop: Callable[[], bool] | None = None,
    layers: Sequence[int] | None = None,
) -> bytes:
    """A read response whole (`encode_chunks`, joined)."""
    return b"".join(encode_chunks(batch, spec, fmt, stop, layers))


def encode_chunks(
    batch: Batch,
    spec: RouteSpec,
    fmt: ReadFormat,
    stop: Callable[[], bool] | None = None,
    layers: Sequence[int] | None = None,
    chunk_bytes: int = CHUNK_BYTES,
) -> Iterator[bytes | memoryview]:
    """A read response, in pieces: one row per stored segment, trajectories in the
    order asked; with `layers` (checked: `RouteSpec.check_layers`), their routes only.
    The first piece is the stream's schema (its metadata: spec, ids, missing, stale),
    then a record batch each time its rows hold `chunk_bytes` of routes, then the
    stream's end: a sender holds one piece at a time, and each row is decoded only when
    its piece is made.

    `batch` must come from `Engine.get_batch(..., decode=False)` (stored streams; with
    `as_stored=True`, rows at rest as stored, with `batch.dictionaries`: each crosses
    the codec once here, decoded for `ids` and `mask`, encoded again to decode alone
    for `encoded`). `stop()` is asked before each segment is decoded: once true (the request was
    answered meanwhile), `StoreError` is raised and nothing more is decoded.
    """
    chosen = None if layers is None else spec.check_layers(layers)
    answer_spec = spec if chosen is None else spec.narrowed(len(chosen))
    meta = {
        "r3store.wire_version": WIRE_VERSION,
        "r3store.format": str(fmt),
        "r3store.route_spec": answer_spec.to_json(),  # of the layers answered
        "r3store.ids": json.dumps(batch.ids),
        "r3store.missing": json.dumps(batch.missing),
        "r3store.stale": json.dumps(batch.stale),
    }
    if chosen is not None:
        meta["r3store.layers"] = json.dumps(list(chosen))
    schema = COLUMNS.with_metadata(meta)
    yield schema.serialize().to_pybytes()
    cols: dict[str, list[Any]] = {name: [] for name in COLUMNS.names}
    held = 0
    seen: set[str] = set()
    for item in batch.items:
        if item is None or item.trajectory_id in seen:
            continue
        seen.add(item.trajectory_id)
        for segment in item.segments:
            if stop is not None and stop():
                raise StoreError("the read was answered before its routes were encoded")
            row = _row(item, segment, spec, answer_spec, fmt, chosen, batch)
            for name, value in row.items():
                cols[name].append(value)
            held += sum(len(v) for v in row.values() if isinstance(v, bytes))
            del row
            if held >= chunk_bytes:
                yield _record_batch(cols, schema)
                cols = {name: [] for name in COLUMNS.names}
                held = 0
    if cols["trajectory_id"]:
        yield _record_batch(cols, schema)
    yield STREAM_END


def _record_batch(cols: dict[str, list[Any]], schema: pa.Schema) -> memoryview:
    """The rows as one record batch message, in a buffer of its own (not copied again
    into bytes: a piece of a large answer is held once)."""
    arrays = [pa.array(cols[f.name], f.type) for f in COLUMNS]
    cols.clear()  # the rows' bytes go as soon as their arrays are made
    return memoryview(pa.record_batch(arrays, schema=schema).serialize())


def _row(
    item: TrajectoryRead,
    segment: SegmentRead,
    spec: RouteSpec,
    answer_spec: RouteSpec,
    fmt: ReadFormat,
    chosen: Sequence[int] | None,
    batch: Batch,
) -> dict[str, Any]:
    """One segment's row of a read answer, its routes in `fmt`."""
    stored = segment.encoded
    if stored is None:
        raise ValueError("encode_batch needs stored streams (decode=False)")
    row: dict[str, Any] = {
        "trajectory_id": item.trajectory_id,
        "start": segment.start,
        "num_tokens": segment.num_tokens,
        "policy_version": segment.policy_version,
        "group_id": item.group_id,
        "prompt_len": item.prompt_len,
        "source": item.source,
        "digest": segment.digest or stored.digest,
    }
    need = None if stored.dictionary is None else batch.dictionaries.get(stored.dictionary)
    if fmt is ReadFormat.ENCODED:
        if chosen is not None:
            stored = codec.layer_subset(stored, spec, segment.num_tokens, chosen, need)
        else:  # streams at rest need a dictionary or a shared prefix: not sent
            stored = codec.portable(stored, spec, segment.num_tokens, need)
        return {
            **row,
            "route_transform": int(stored.transform),
            "route_ids": stored.ids,
            "route_counts": stored.counts,
            "route_order": stored.order,
            "token_ids": stored.tokens,
        }
    routes = codec.decode(stored, spec, segment.num_tokens, need)
    if chosen is not None:
        counts_of = routes.layer_counts
        routes = Routes(
            routes.layers[list(chosen)],
            None if counts_of is None else counts_of[list(chosen)],
        )
    if fmt is ReadFormat.IDS:
        ids = routes.ids
        counts = None if routes.layer_counts is None else routes.counts.tobytes()
    else:
        ids, counts = to_mask(routes, answer_spec), None
    del routes
    tokens = None
    if stored.tokens is not None:
        tokens = codec.decode_tokens(stored.tokens, segment.num_tokens).tobytes()
    little = ids.dtype.newbyteorder("<")
    return {
        **row,
        "route_transform": None,
        "route_ids": np.ascontiguousarray(ids, dtype=little).tobytes(),  # one copy
        "route_counts": counts,
        "route_order": None,
        "token_ids": tokens,
    }


def decode_batch(
    body: bytes, decode: bool = True, executor: Executor | None = None
) -> tuple[RouteSpec, Batch]:
    """Parse a read response into the spec and a `Batch` (routes decoded unless asked
    not; trajectories decoded in parallel on `executor` if given: zstd and numpy
    release the GIL)."""
    table = read_table(body)
    try:
        meta: dict[str, Any] = {
            k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()
        }
        version = meta.get("r3store.wire_version")
        if version != WIRE_VERSION:
            raise InvalidInput(f"wire version {version!r} is not {WIRE_VERSION!r}")
        spec = RouteSpec.from_json(meta["r3store.route_spec"])
        fmt = ReadFormat(meta["r3store.format"])
        ids = json.loads(meta["r3store.ids"])
        missing, stale = json.loads(meta["r3store.missing"]), json.loads(meta["r3store.stale"])
        layers = None
        if "r3store.layers" in meta:
            layers = tuple(json.loads(meta["r3store.layers"]))
            if len(layers) != spec.num_layers or not all(type(x) is int for x in layers):
                raise ValueError("r3store.layers does not match the answer's spec")
    except (UnicodeDecodeError, KeyError, ValueError) as exc:
        raise InvalidInput(f"the body is not an r3store read answer: {exc}") from None
    by_id: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        by_id.setdefault(row["trajectory_id"], []).append(row)
    work = list(by_id.values())
    if decode and executor is not None and len(work) > 1:
        done = list(executor.map(lambda segs: _trajectory(segs, spec, fmt, decode), work))
    else:
        done = [_trajectory(segs, spec, fmt, decode) for segs in work]
    reads = {item.trajectory_id: item for item in done}
    items: list[TrajectoryRead | None] = [reads.get(tid) for tid in ids]
    return spec, Batch(ids, items, missing, stale, layers)


def _trajectory(
    rows: list[dict[str, Any]], spec: RouteSpec, fmt: ReadFormat, decode: bool
) -> TrajectoryRead:
    segments, parts, tokens = [], [], []
    for row in rows:
        n = row["num_tokens"]
        digest = row.get("digest") or b""
        stored = None
        if fmt is ReadFormat.ENCODED:
            if row["route_transform"] not in TRANSFORMS:
                raise InvalidInput(f"unknown route transform {row['route_transform']!r}")
            stored = EncodedRoutes(
                row["route_ids"],
                row["route_counts"],
                row["route_order"],
                Transform(row["route_transform"]),
                digest,
                row["token_ids"],
            )
        segments.append(SegmentRead(row["start"], n, row["policy_version"], stored, digest))
        if not decode:
            continue
        blob = row["token_ids"]
        if stored is not None:
            parts.append(codec.decode(stored, spec, n))
            tokens.append(None if blob is None else codec.decode_tokens(blob, n))
        else:
            parts.append(_plain_routes(row, spec, fmt, n))
            tokens.append(None if blob is None else np.frombuffer(blob, "<i4"))
    first = rows[0]
    identity = (first["trajectory_id"], first["group_id"], first["prompt_len"])
    source = check_source(first.get("source") or ENGINE)
    if not decode:
        return assemble(segments, identity, source=source)
    return assemble(segments, identity, parts, tokens, source)


def _plain_routes(row: dict[str, Any], spec: RouteSpec, fmt: ReadFormat, n: int) -> Routes:
    if fmt is ReadFormat.MASK:
        mask = np.frombuffer(row["route_ids"], np.uint8).reshape(
            n, spec.num_layers, spec.mask_bytes
        )
        return from_mask(mask, spec, n)
    ids = np.frombuffer(row["route_ids"], spec.id_dtype.newbyteorder("<"))
    layers = ids.reshape(n, spec.num_layers, spec.top_k).transpose(1, 0, 2)
    counts = None
    if row["route_counts"] is not None:
        counts = np.frombuffer(row["route_counts"], np.uint8).reshape(n, spec.num_layers).T
    return Routes(
        np.ascontiguousarray(layers, spec.id_dtype),
        None if counts is None else np.ascontiguousarray(counts),
    )
