"""Shards: immutable Parquet objects holding many trajectories' routes and metadata.

One shard belongs to one namespace. Each row is one trajectory; columns are listed in
`SCHEMA` and docs/format.md. Metadata columns are zstd-compressed by Parquet; the route
columns already hold zstd frames (see `r3store.codec`) and are stored as they are. Row
groups hold about `row_group_bytes` of routes, at least one trajectory each, so reading
one trajectory reads one row group, and a batch read fetches each row group it needs
with one ranged GET.
"""

from __future__ import annotations

import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.parquet as pq

from r3store.codec import EncodedRoutes
from r3store.errors import CorruptShard
from r3store.spec import RouteSpec
from r3store.store.base import ByteRange

FORMAT_VERSION = "1"
META_FORMAT = b"r3store.format_version"
META_SPEC = b"r3store.route_spec"
META_NAMESPACE = b"r3store.namespace"
META_CREATED = b"r3store.created_at"
SHARD_PREFIX = "shards/"

SCHEMA = pa.schema(
    [
        pa.field("namespace", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("digest", pa.binary(16), nullable=False),
        pa.field("route_transform", pa.int8(), nullable=False),
        pa.field("route_ids", pa.binary(), nullable=False),
        pa.field("route_counts", pa.binary()),
        pa.field("route_order", pa.binary()),
    ]
)
META_COLUMNS = [
    f.name for f in SCHEMA if not f.name.startswith("route_") or f.name == "route_transform"
]
ROUTE_COLUMNS = ["route_ids", "route_counts", "route_order"]


@dataclass(frozen=True)
class ShardRow:
    """One trajectory as it goes into a shard."""

    trajectory_id: str
    group_id: str | None
    policy_version: int
    num_tokens: int
    prompt_len: int
    digest: bytes
    routes: EncodedRoutes


@dataclass(frozen=True)
class RowPlace:
    row_group: int
    row: int  # within the row group


@dataclass(frozen=True)
class BuiltShard:
    key: str
    data: bytes
    places: list[RowPlace]  # one per input row, in input order
    footer_length: int
    created_at: float


def new_shard_key(namespace: str, now: float | None = None) -> str:
    """A unique, time-ordered key: `shards/<namespace>/<ms since epoch>-<uuid>.parquet`."""
    ms = int((time.time() if now is None else now) * 1000)
    return f"{SHARD_PREFIX}{namespace}/{ms:013d}-{uuid.uuid4().hex}.parquet"


def _table(namespace: str, rows: Sequence[ShardRow]) -> pa.Table:
    return pa.table(
        {
            "namespace": pa.array([namespace] * len(rows), pa.string()),
            "trajectory_id": [r.trajectory_id for r in rows],
            "group_id": pa.array([r.group_id for r in rows], pa.string()),
            "policy_version": pa.array([r.policy_version for r in rows], pa.int64()),
            "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
            "prompt_len": pa.array([r.prompt_len for r in rows], pa.int32()),
            "digest": pa.array([r.digest for r in rows], pa.binary(16)),
            "route_transform": pa.array([int(r.routes.transform) for r in rows], pa.int8()),
            "route_ids": pa.array([r.routes.ids for r in rows], pa.binary()),
            "route_counts": pa.array([r.routes.counts for r in rows], pa.binary()),
            "route_order": pa.array([r.routes.order for r in rows], pa.binary()),
        },
        schema=SCHEMA,
    )


def build_shard(
    namespace: str, spec: RouteSpec, rows: Sequence[ShardRow], row_group_bytes: int
) -> BuiltShard:
    """Write `rows` into one Parquet file in memory."""
    if not rows:
        raise ValueError("a shard needs at least one row")
    created = time.time()
    key = new_shard_key(namespace, created)
    metadata = {
        META_FORMAT: FORMAT_VERSION.encode(),
        META_SPEC: spec.to_json().encode(),
        META_NAMESPACE: namespace.encode(),
        META_CREATED: repr(created).encode(),
    }
    schema = SCHEMA.with_metadata(metadata)
    compression: dict[str | bytes, str] = {name: "ZSTD" for name in META_COLUMNS}
    compression.update({name: "NONE" for name in ROUTE_COLUMNS})
    sink = io.BytesIO()
    places: list[RowPlace] = []
    with pq.ParquetWriter(
        sink,
        schema,
        compression=compression,
        use_dictionary=["namespace", "group_id"],
        write_statistics=["trajectory_id", "policy_version", "num_tokens"],
        data_page_size=row_group_bytes,
    ) as writer:
        start = 0
        group = 0
        while start < len(rows):
            end, size = start, 0
            while end < len(rows) and (
                end == start or size + rows[end].routes.nbytes <= row_group_bytes
            ):
                size += rows[end].routes.nbytes
                end += 1
            writer.write_table(_table(namespace, rows[start:end]).replace_schema_metadata(metadata))
            places.extend(RowPlace(group, i) for i in range(end - start))
            start, group = end, group + 1
    data = sink.getvalue()
    footer_length = int.from_bytes(data[-8:-4], "little")
    return BuiltShard(key, data, places, footer_length, created)


def footer_range(size: int, footer_length: int) -> ByteRange:
    """Where the Parquet footer (metadata, its length and the magic) lies."""
    return ByteRange(size - footer_length - 8, size)


def parse_footer(tail: bytes) -> pq.FileMetaData:
    """Parse the bytes from `footer_range` (or any longer tail of the file)."""
    if len(tail) < 12 or tail[-4:] != b"PAR1":
        raise CorruptShard("not a Parquet file: the magic bytes are missing")
    length = int.from_bytes(tail[-8:-4], "little")
    if length + 8 > len(tail):
        raise CorruptShard(f"footer of {length} bytes does not fit in the {len(tail)} bytes read")
    try:
        return pq.read_metadata(pa.BufferReader(b"PAR1" + tail[-(length + 8) :]))
    except (pa.ArrowException, OSError) as exc:
        raise CorruptShard(f"cannot parse the Parquet footer: {exc}") from exc


def shard_spec(metadata: pq.FileMetaData) -> tuple[str, RouteSpec]:
    """The namespace and route spec a shard was written with; checks the format version."""
    kv = metadata.metadata or {}
    version = kv.get(META_FORMAT, b"").decode()
    if version != FORMAT_VERSION:
        raise CorruptShard(f"shard format version {version!r}; this build reads {FORMAT_VERSION!r}")
    return kv[META_NAMESPACE].decode(), RouteSpec.from_json(kv[META_SPEC])


def row_group_range(metadata: pq.FileMetaData, row_group: int) -> ByteRange:
    """The bytes of all column chunks of one row group."""
    rg = metadata.row_group(row_group)
    starts, ends = [], []
    for i in range(rg.num_columns):
        col = rg.column(i)
        first = col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset
        starts.append(first)
        ends.append(first + col.total_compressed_size)
    return ByteRange(min(starts), max(ends))


class _Prefetched(io.RawIOBase):
    """A read-only file of `size` bytes of which only one range is present."""

    def __init__(self, size: int, start: int, data: bytes) -> None:
        self._size, self._start, self._data, self._pos = size, start, data, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: self._size}[whence]
        self._pos = base + offset
        return self._pos

    def read(self, n: int = -1) -> bytes:
        if n < 0:
            n = self._size - self._pos
        lo = self._pos - self._start
        if lo < 0 or lo + n > len(self._data):
            raise OSError(f"read of [{self._pos}, {self._pos + n}) outside the fetched range")
        self._pos += n
        return self._data[lo : lo + n]


def read_row_group(
    metadata: pq.FileMetaData,
    size: int,
    row_group: int,
    chunk: bytes,
    columns: list[str] | None = None,
) -> pa.Table:
    """Decode one row group from the bytes `row_group_range` fetched."""
    span = row_group_range(metadata, row_group)
    source = pa.PythonFile(_Prefetched(size, span.start, chunk), mode="r")
    try:
        return pq.ParquetFile(source, metadata=metadata).read_row_group(row_group, columns=columns)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptShard(f"cannot read row group {row_group}: {exc}") from exc


def row_routes(table: pa.Table, row: int) -> tuple[bytes, bytes | None, bytes | None, int]:
    """The stored route streams of one row, as `r3store.codec.decode` takes them."""
    return (
        table.column("route_ids")[row].as_py(),
        table.column("route_counts")[row].as_py(),
        table.column("route_order")[row].as_py(),
        int(table.column("route_transform")[row].as_py()),
    )


def read_rows_meta(data: bytes) -> tuple[pq.FileMetaData, pa.Table]:
    """A whole shard's footer and metadata columns (for catalog rebuilds)."""
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        return pf.metadata, pf.read(columns=META_COLUMNS)
    except (pa.ArrowException, OSError) as exc:
        raise CorruptShard(f"cannot read shard: {exc}") from exc


def places_of(metadata: pq.FileMetaData) -> list[RowPlace]:
    """Row group and row of every row, in file order."""
    out: list[RowPlace] = []
    for g in range(metadata.num_row_groups):
        out.extend(RowPlace(g, i) for i in range(metadata.row_group(g).num_rows))
    return out
