"""The binary wire formats: Arrow IPC streams for trajectories in and routes out.

Routes never travel as JSON. Both directions are Arrow IPC *streams* (the format of
`pyarrow.ipc.new_stream`, Arrow C++ `RecordBatchStreamWriter`, arrow-rs `StreamWriter`);
docs/api.md lists every column. Shared by the server and the client.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from enum import StrEnum
from typing import Any, Protocol

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from r3store.errors import InvalidInput, InvalidRoutes, StoreError
from r3store.logic import codec
from r3store.logic.codec import EncodedRoutes, Transform
from r3store.logic.routes import Routes, from_mask, to_mask
from r3store.logic.streams import MAX_UPLOAD_BYTES, SentStreams, decoded_bytes
from r3store.policy import ENGINE
from r3store.protocol.ipc import read_table
from r3store.records import (
    Batch,
    SegmentRead,
    TrajectoryRead,
    TrajectoryWrite,
    assemble,
    check_source,
)
from r3store.spec import RouteSpec

WIRE_VERSION = "1"
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
MAX_ROWS = 100_000
ROUTE_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


class RouteKind(StrEnum):
    TOPK = "topk"  # [rows, L, K] expert ids, -1 for an empty slot
    MASK = "mask"  # [rows, L, ceil(E/8)] uint8 bit-packed sets
    ENCODED = "encoded"  # the streams codec.encode makes (r3store.logic.streams checks them)


class ReadFormat(StrEnum):
    ENCODED = "encoded"  # the stored zstd streams, as they are (fastest; decode with r3store)
    IDS = "ids"  # [T, L, K] ids of the id dtype, token-major, and counts
    MASK = "mask"  # [T, L, ceil(E/8)] bit-packed masks, token-major


# ---- writes: client -> server


UPLOAD_COLUMNS = {  # the columns `encode_writes` sends, with their Arrow types
    "trajectory_id": pa.string(),
    "num_tokens": pa.int64(),
    "start": pa.int64(),
    "prompt_len": pa.int64(),
    "policy_version": pa.int64(),
    "group_id": pa.string(),
    "routes_kind": pa.string(),
    "routes_dtype": pa.string(),
    "routes": pa.large_binary(),
    "route_transform": pa.int8(),
    "route_counts": pa.large_binary(),
    "route_order": pa.large_binary(),
    "token_ids": pa.large_binary(),
    "source": pa.string(),
}


def encode_writes(writes: Sequence[TrajectoryWrite]) -> bytes:
    """An upload body: one row per trajectory (or appended segment)."""
    rows: dict[str, list[Any]] = {name: [] for name in UPLOAD_COLUMNS}
    for w in writes:
        extra: tuple[Any, ...] = (None, None, None)
        if w.encoded is not None:
            kind, dtype, routes = RouteKind.ENCODED, None, w.encoded.ids
            extra = (w.encoded.transform, w.encoded.counts, w.encoded.order)
        else:
            kind = RouteKind.TOPK if w.topk is not None else RouteKind.MASK
            arr = np.ascontiguousarray(w.topk if w.topk is not None else w.mask)
            if arr.dtype.name not in ROUTE_DTYPES:
                raise InvalidRoutes(
                    f"{w.trajectory_id}: routes must be integers ({', '.join(ROUTE_DTYPES)}), "
                    f"got dtype {arr.dtype}"
                )
            dtype, routes = arr.dtype.name, arr.astype(arr.dtype.newbyteorder("<")).tobytes()
        tokens = w.tokens()
        values = [
            *(w.trajectory_id, w.num_tokens, w.start, w.prompt_len, w.policy_version),
            *(w.group_id, str(kind), dtype, routes, *extra),
            None if tokens is None else tokens.astype("<i4").tobytes(),
            w.source,
        ]
        for name, value in zip(UPLOAD_COLUMNS, values, strict=True):
            rows[name].append(value)
    arrays = {name: pa.array(rows[name], type_) for name, type_ in UPLOAD_COLUMNS.items()}
    return _stream(pa.table(arrays))


def _stream(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def _column(table: pa.Table, name: str, kind: str, default: Any = None) -> list[Any]:
    """The values of a validated column (binary ones as zero-copy buffers); `default`
    stands in for an absent column and for nulls (None: the column is required)."""
    if name not in table.column_names:
        if default is None:
            raise InvalidInput(f"the upload has no {name!r} column")
        return [default] * table.num_rows
    column = table.column(name)
    checks = {
        "int": pa.types.is_integer,
        "str": lambda t: pa.types.is_string(t) or pa.types.is_large_string(t),
        "bin": lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t),
    }
    if not checks[kind](column.type):
        raise InvalidInput(f"column {name!r} has type {column.type}; expected {kind}")
    if kind == "bin":
        values: list[Any] = [value for chunk in column.chunks for value in _binaries(chunk)]
    else:
        values = column.to_pylist()
    if default is not None:
        values = [default if v is None else v for v in values]
    return values


def _binaries(chunk: pa.Array) -> list[pa.Buffer | None]:
    """The values of a validated binary array as views of its data buffer (a scalar
    per value would copy each one)."""
    _validity, offsets_buffer, data = chunk.buffers()
    if len(chunk) == 0:
        return []
    data = data if data is not None else pa.py_buffer(b"")  # every value empty
    width = np.int64 if pa.types.is_large_binary(chunk.type) else np.int32
    # validation checked that the buffer holds these offsets; it may hold stray bytes after
    offsets = np.frombuffer(offsets_buffer, width, count=chunk.offset + len(chunk) + 1)
    offsets = offsets[chunk.offset :]
    valid = chunk.is_valid().to_pylist()
    return [
        data.slice(int(offsets[i]), int(offsets[i + 1] - offsets[i])) if valid[i] else None
        for i in range(len(chunk))
    ]


def route_shape_error(values: int, num_tokens: int, spec: RouteSpec, kind: str) -> str:
    """Why `values` route values cannot be `[T or T-1, L, W]` for `num_tokens` tokens, in
    terms of what they would be instead (the wrong layer count or width), or ""."""
    name = "top_k" if kind == RouteKind.TOPK else "ceil(num_experts / 8)"
    width = spec.top_k if kind == RouteKind.TOPK else spec.mask_bytes
    layers = spec.num_layers
    want = f"[{num_tokens} or {num_tokens - 1}, {layers}, {width}]"
    if values < 0:
        return f"not whole values; expected {want}"
    for rows in (num_tokens, num_tokens - 1):
        if rows > 0 and values == rows * layers * width:
            return ""
    readings: list[str] = []
    for rows in (num_tokens, num_tokens - 1):
        if rows <= 0 or values % rows:
            continue
        per_token = values // rows
        if per_token % width == 0:
            readings.append(f"[{rows}, {per_token // width}, {width}] (the layer count differs)")
        if per_token % layers == 0:
            readings.append(f"[{rows}, {layers}, {per_token // layers}] ({name} differs)")
        if readings:
            break  # T rows read first; T-1 only when T gives no reading
    if values % (layers * width) == 0:
        readings.append(
            f"[{values // (layers * width)}, {layers}, {width}] (the token count differs)"
        )
    if not readings:
        return f"{values} values cannot be read as [tokens, layers, {name}]; expected {want}"
    return (
        f"that is {' or '.join(readings)}; the namespace has {layers} layers and {name} "
        f"{width}, the trajectory {num_tokens} tokens: expected {want}"
    )


def decode_writes(
    body: bytes | bytearray | memoryview,
    spec: RouteSpec,
    max_rows: int = MAX_ROWS,
    admit: Callable[[int], None] | None = None,
) -> list[TrajectoryWrite]:
    """Parse an upload body into writes (the stream fully validated first, shapes and
    dtypes checked; routes are validated later, on the values as sent).

    More than `max_rows` rows raise `PayloadTooLarge` before their batch is validated;
    `admit(rows)` is called once the rows are counted, before any write is made (a
    memory budget charges them there, or refuses them)."""
    table = read_table(body, min(max_rows, MAX_ROWS))
    if table.num_rows == 0:
        raise InvalidInput("the upload holds no rows")
    if admit is not None:
        admit(table.num_rows)
    ids = _column(table, "trajectory_id", "str")
    num_tokens = _column(table, "num_tokens", "int")
    blobs = _column(table, "routes", "bin")
    starts = _column(table, "start", "int", 0)
    prompts = _column(table, "prompt_len", "int", 0)
    versions = _column(table, "policy_version", "int", 0)
    groups = (
        _column(table, "group_id", "str", "")
        if "group_id" in table.column_names
        else [None] * table.num_rows
    )
    kinds = _column(table, "routes_kind", "str", "topk")
    dtypes = _column(table, "routes_dtype", "str", "int32")
    encoded = RouteKind.ENCODED in kinds
    transforms = _column(table, "route_transform", "int", -1) if encoded else []
    counts = _optional_binaries(table, "route_counts") if encoded else []
    orders = _optional_binaries(table, "route_order") if encoded else []
    tokens = _optional_binaries(table, "token_ids")
    sources = _column(table, "source", "str", ENGINE)
    if encoded:  # what checking them will decompress, bounded first
        total = sum(
            decoded_bytes(spec, max(0, n or 0))
            for n, kind in zip(num_tokens, kinds, strict=True)
            if kind == RouteKind.ENCODED
        )
        if total > MAX_UPLOAD_BYTES:
            raise InvalidInput(
                f"the upload's encoded routes decode to {total} bytes; at most "
                f"{MAX_UPLOAD_BYTES} in one upload: send fewer at a time"
            )
    writes = []
    for i in range(table.num_rows):
        if ids[i] is None or num_tokens[i] is None or blobs[i] is None:
            raise InvalidInput(f"row {i}: trajectory_id, num_tokens and routes are required")
        kind, dtype = kinds[i], dtypes[i]
        if kind not in set(RouteKind):
            raise InvalidInput(
                f"{ids[i]}: routes_kind must be 'topk', 'mask' or 'encoded', got {kind!r}"
            )
        token_ids = _token_ids(ids[i], tokens[i])
        group = groups[i] if groups[i] != "" else None
        meta: dict[str, Any] = {
            "trajectory_id": ids[i],
            "num_tokens": num_tokens[i],
            "prompt_len": prompts[i],
            "group_id": group,
            "policy_version": versions[i],
            "start": starts[i],
            "token_ids": token_ids,
            "source": check_source(sources[i]),
        }
        if kind == RouteKind.ENCODED:
            if transforms[i] < 0:
                raise InvalidInput(f"{ids[i]}: encoded routes need a route_transform")
            counts_i, order_i = counts[i], orders[i]
            sent = SentStreams(
                bytes(blobs[i]),  # compressed: small, and kept apart from the body
                transforms[i],
                None if counts_i is None else bytes(counts_i),
                None if order_i is None else bytes(order_i),
            )
            writes.append(TrajectoryWrite(**meta, encoded=sent))
            continue
        if dtype not in ROUTE_DTYPES:
            raise InvalidInput(
                f"{ids[i]}: routes_dtype must be one of {ROUTE_DTYPES}, got {dtype!r}"
            )
        width = spec.top_k if kind == RouteKind.TOPK else spec.mask_bytes
        itemsize = np.dtype(dtype).itemsize
        shape_error = route_shape_error(
            blobs[i].size // itemsize if blobs[i].size % itemsize == 0 else -1,
            num_tokens[i],
            spec,
            kind,
        )
        if shape_error:
            raise InvalidRoutes(
                f"{ids[i]}: {blobs[i].size} bytes of {dtype} {kind} routes: {shape_error}"
            )
        arr = np.frombuffer(blobs[i], dtype=np.dtype(dtype).newbyteorder("<"))
        arr = arr.reshape(-1, spec.num_layers, width)
        if kind == RouteKind.TOPK:
            writes.append(TrajectoryWrite(**meta, topk=arr))
        else:
            writes.append(TrajectoryWrite(**meta, mask=arr))
    return writes


def _optional_binaries(table: pa.Table, name: str) -> list[Any]:
    if name not in table.column_names:
        return [None] * table.num_rows
    return _column(table, name, "bin")


def _token_ids(trajectory_id: str, blob: Any) -> npt.NDArray[np.int32] | None:
    if blob is None:
        return None
    if blob.size % 4:
        raise InvalidInput(f"{trajectory_id}: token_ids must be int32 little-endian")
    return np.frombuffer(blob, dtype="<i4")


# ---- reads: server -> client


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


def encode_batch(
    batch: Batch,
    spec: RouteSpec,
    fmt: ReadFormat,
    stop: Callable[[], bool] | None = None,
    layers: Sequence[int] | None = None,
) -> bytes:
    """A read response: one row per stored segment, trajectories in the order asked;
    with `layers` (checked: `RouteSpec.check_layers`), their routes only.

    `batch` must come from `Engine.get_batch(..., decode=False)` (stored streams).
    `stop()` is asked before each segment is decoded: once true (the request was
    answered meanwhile), `StoreError` is raised and nothing more is decoded.
    """
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "trajectory_id",
            "start",
            "num_tokens",
            "policy_version",
            "group_id",
            "prompt_len",
            "route_transform",
            "route_ids",
            "route_counts",
            "route_order",
            "token_ids",
            "source",
            "digest",
        )
    }
    chosen = None if layers is None else spec.check_layers(layers)
    answer_spec = spec if chosen is None else spec.narrowed(len(chosen))
    seen: set[str] = set()
    for item in batch.items:
        if item is None or item.trajectory_id in seen:
            continue
        seen.add(item.trajectory_id)
        for segment in item.segments:
            stored = segment.encoded
            if stored is None:
                raise ValueError("encode_batch needs stored streams (decode=False)")
            cols["trajectory_id"].append(item.trajectory_id)
            cols["start"].append(segment.start)
            cols["num_tokens"].append(segment.num_tokens)
            cols["policy_version"].append(segment.policy_version)
            cols["group_id"].append(item.group_id)
            cols["prompt_len"].append(item.prompt_len)
            cols["source"].append(item.source)
            cols["digest"].append(segment.digest or stored.digest)
            if stop is not None and stop():
                raise StoreError("the read was answered before its routes were encoded")
            if fmt is ReadFormat.ENCODED:
                if chosen is not None:
                    stored = codec.layer_subset(stored, spec, segment.num_tokens, chosen)
                cols["route_transform"].append(int(stored.transform))
                cols["route_ids"].append(stored.ids)
                cols["route_counts"].append(stored.counts)
                cols["route_order"].append(stored.order)
                cols["token_ids"].append(stored.tokens)
                continue
            routes = codec.decode(stored, spec, segment.num_tokens)
            if chosen is not None:
                counts_of = routes.layer_counts
                routes = Routes(
                    routes.layers[list(chosen)],
                    None if counts_of is None else counts_of[list(chosen)],
                )
            if fmt is ReadFormat.IDS:
                ids = np.ascontiguousarray(routes.ids)
                counts = None if routes.layer_counts is None else routes.counts.tobytes()
            else:
                ids, counts = to_mask(routes, answer_spec), None
            cols["route_transform"].append(None)
            cols["route_ids"].append(ids.astype(ids.dtype.newbyteorder("<")).tobytes())
            cols["route_counts"].append(counts)
            cols["route_order"].append(None)
            tokens = None
            if stored.tokens is not None:
                tokens = codec.decode_tokens(stored.tokens, segment.num_tokens).tobytes()
            cols["token_ids"].append(tokens)
    table = pa.table(
        {
            "trajectory_id": pa.array(cols["trajectory_id"], pa.string()),
            "start": pa.array(cols["start"], pa.int64()),
            "num_tokens": pa.array(cols["num_tokens"], pa.int64()),
            "policy_version": pa.array(cols["policy_version"], pa.int64()),
            "group_id": pa.array(cols["group_id"], pa.string()),
            "prompt_len": pa.array(cols["prompt_len"], pa.int64()),
            "route_transform": pa.array(cols["route_transform"], pa.int8()),
            "route_ids": pa.array(cols["route_ids"], pa.large_binary()),
            "route_counts": pa.array(cols["route_counts"], pa.large_binary()),
            "route_order": pa.array(cols["route_order"], pa.large_binary()),
            "token_ids": pa.array(cols["token_ids"], pa.large_binary()),
            "source": pa.array(cols["source"], pa.string()),
            "digest": pa.array(cols["digest"], pa.binary()),
        }
    )
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
    return _stream(table.replace_schema_metadata(meta))


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
            if row["route_transform"] not in set(Transform):
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
