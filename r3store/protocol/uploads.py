"""The upload format, client -> server: one Arrow IPC stream, a row per trajectory (or
appended segment), its routes as top-k ids, bit-packed masks or the client's own
encoded streams (docs/api.md lists the columns). `encode_writes` writes one;
`decode_writes` reads one nobody has checked (through `ipc.py`), refusing a wrong
shape with the reading it would have instead (`route_shape_error`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import numpy.typing as npt
import pyarrow as pa

from r3store.errors import InvalidInput, InvalidRoutes
from r3store.logic.streams import MAX_UPLOAD_BYTES, checking_bytes, decoded_bytes
from r3store.policy import ENGINE
from r3store.protocol.formats import (
    MAX_ROWS,
    ROUTE_DTYPES,
    RouteKind,
    arrow_stream,
)
from r3store.protocol.ipc import read_table
from r3store.records import (
    TrajectoryWrite,
    check_source,
)
from r3store.route_types import SentStreams
from r3store.spec import RouteSpec

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
    return arrow_stream(pa.table(arrays))


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
    # no nulls (the usual column): no compute kernel, whose call costs more than the rows
    valid = [True] * len(chunk) if chunk.null_count == 0 else chunk.is_valid().to_pylist()
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
    admit: Callable[[int, int], None] | None = None,
) -> list[TrajectoryWrite]:
    """Parse an upload body into writes (the stream fully validated first, shapes and
    dtypes checked; routes are validated later, on the values as sent).

    More than `max_rows` rows raise `PayloadTooLarge` before their batch is validated;
    `admit(rows, checking)` is called once the rows are counted, before any write is
    made or any stream decompressed (a memory budget charges them there, or refuses
    them): `checking` is what checking its largest encoded segment will hold
    (`streams.checking_bytes`; segments are checked one at a time), 0 without any."""
    table = read_table(body, min(max_rows, MAX_ROWS))
    if table.num_rows == 0:
        raise InvalidInput("the upload holds no rows")
    num_tokens = _column(table, "num_tokens", "int")
    kinds = _column(table, "routes_kind", "str", "topk")
    encoded = RouteKind.ENCODED in kinds
    checking = _checking(spec, num_tokens, kinds)
    if admit is not None:
        admit(table.num_rows, checking)
    ids = _column(table, "trajectory_id", "str")
    blobs = _column(table, "routes", "bin")
    starts = _column(table, "start", "int", 0)
    prompts = _column(table, "prompt_len", "int", 0)
    versions = _column(table, "policy_version", "int", 0)
    groups = (
        _column(table, "group_id", "str", "")
        if "group_id" in table.column_names
        else [None] * table.num_rows
    )
    dtypes = _column(table, "routes_dtype", "str", "int32")
    transforms = _column(table, "route_transform", "int", -1) if encoded else []
    counts = _optional_binaries(table, "route_counts") if encoded else []
    orders = _optional_binaries(table, "route_order") if encoded else []
    tokens = _optional_binaries(table, "token_ids")
    sources = _column(table, "source", "str", ENGINE)
    writes = []
    for i in range(table.num_rows):
        if ids[i] is None or num_tokens[i] is None or blobs[i] is None:
            raise InvalidInput(f"row {i}: trajectory_id, num_tokens and routes are required")
        kind = kinds[i]
        if kind not in set(RouteKind):
            raise InvalidInput(
                f"{ids[i]}: routes_kind must be 'topk', 'mask' or 'encoded', got {kind!r}"
            )
        group = groups[i] if groups[i] != "" else None
        meta = TrajectoryWrite(
            trajectory_id=ids[i],
            num_tokens=num_tokens[i],
            prompt_len=prompts[i],
            group_id=group,
            policy_version=versions[i],
            start=starts[i],
            token_ids=_token_ids(ids[i], tokens[i]),
            source=check_source(sources[i]),
        )
        if kind == RouteKind.ENCODED:
            writes.append(_encoded(meta, blobs[i], transforms[i], counts[i], orders[i]))
        else:
            writes.append(_arrays(meta, blobs[i], kind, dtypes[i], spec))
    return writes


def _checking(spec: RouteSpec, num_tokens: list[Any], kinds: list[Any]) -> int:
    """What checking the largest encoded segment will hold, once what checking them all
    will decompress is bounded."""
    lengths = [
        max(0, n or 0)
        for n, kind in zip(num_tokens, kinds, strict=True)
        if kind == RouteKind.ENCODED
    ]
    total = sum(decoded_bytes(spec, n) for n in lengths)
    if total > MAX_UPLOAD_BYTES:
        raise InvalidInput(
            f"the upload's encoded routes decode to {total} bytes; at most "
            f"{MAX_UPLOAD_BYTES} in one upload: send fewer at a time"
        )
    return checking_bytes(spec, max(lengths, default=0))


def _encoded(
    meta: TrajectoryWrite, blob: Any, transform: int, counts: Any, order: Any
) -> TrajectoryWrite:
    """A row of encoded streams, kept as sent (checked later, by decoding)."""
    if transform < 0:
        raise InvalidInput(f"{meta.trajectory_id}: encoded routes need a route_transform")
    sent = SentStreams(
        bytes(blob),  # compressed: small, and kept apart from the body
        transform,
        None if counts is None else bytes(counts),
        None if order is None else bytes(order),
    )
    return replace(meta, encoded=sent)


def _arrays(
    meta: TrajectoryWrite, blob: Any, kind: str, dtype: str, spec: RouteSpec
) -> TrajectoryWrite:
    """A row of top-k ids or masks as `[T or T-1, L, W]`, shape and dtype checked."""
    if dtype not in ROUTE_DTYPES:
        raise InvalidInput(
            f"{meta.trajectory_id}: routes_dtype must be one of {ROUTE_DTYPES}, got {dtype!r}"
        )
    width = spec.top_k if kind == RouteKind.TOPK else spec.mask_bytes
    itemsize = np.dtype(dtype).itemsize
    shape_error = route_shape_error(
        blob.size // itemsize if blob.size % itemsize == 0 else -1,
        meta.num_tokens,
        spec,
        kind,
    )
    if shape_error:
        raise InvalidRoutes(
            f"{meta.trajectory_id}: {blob.size} bytes of {dtype} {kind} routes: {shape_error}"
        )
    arr = np.frombuffer(blob, dtype=np.dtype(dtype).newbyteorder("<"))
    arr = arr.reshape(-1, spec.num_layers, width)
    if kind == RouteKind.TOPK:
        return replace(meta, topk=arr)
    return replace(meta, mask=arr)


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
