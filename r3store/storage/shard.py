"""Shards: immutable Parquet objects holding many trajectories' routes and metadata.

One shard belongs to one namespace. Each row is one trajectory segment (a whole
trajectory, or one turn appended to it); columns are listed in
`SCHEMA` and docs/format.md. Metadata columns are zstd-compressed by Parquet; the route
columns already hold zstd frames (see `r3store.logic.codec`) and are stored as they are. Row
groups hold about `row_group_bytes` of routes, at least one trajectory each, so reading
one trajectory reads one row group, and a batch read fetches each row group it needs
with one ranged GET. `build_shard` writes a shard; `read_shard` reads one back (a
catalog rebuild), shards of every format version in `READ_VERSIONS`.
"""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from r3store.errors import CorruptShard
from r3store.policy import ENGINE, Source
from r3store.records import check_source
from r3store.route_types import EncodedRoutes
from r3store.spans import RouteSpans, Span
from r3store.spec import RouteSpec
from r3store.storage.keys import shard_key
from r3store.transforms import Transform

# 3: dictionaries and shared prefixes; 2: the `source` column; 1 (engine routes only)
FORMAT_VERSION = "3"
READ_VERSIONS = ("1", "2", "3")
SEGMENT, PREFIX = "segment", "prefix"  # the `kind` of a row
META_FORMAT = b"r3store.format_version"
META_SPEC = b"r3store.route_spec"
META_NAMESPACE = b"r3store.namespace"
META_CREATED = b"r3store.created_at"
META_REST_LEVEL = b"r3store.rest_level"  # the zstd level maintenance wrote it at, if it did

SCHEMA = pa.schema(
    [
        pa.field("namespace", pa.string(), nullable=False),
        pa.field("trajectory_id", pa.string(), nullable=False),
        pa.field("start", pa.int64(), nullable=False),
        pa.field("group_id", pa.string()),
        pa.field("policy_version", pa.int64(), nullable=False),
        pa.field("num_tokens", pa.int32(), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("digest", pa.binary(16), nullable=False),
        pa.field("route_transform", pa.int8(), nullable=False),
        pa.field("route_ids", pa.binary(), nullable=False),
        pa.field("route_counts", pa.binary()),
        pa.field("route_order", pa.binary()),
        pa.field("token_ids", pa.binary()),
        pa.field("source", pa.string(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("route_dictionary", pa.binary(16)),
        pa.field("prefix_digest", pa.binary(16)),
        pa.field("prefix_tokens", pa.int32(), nullable=False),
    ]
)
META_COLUMNS = [
    f.name for f in SCHEMA if not f.name.startswith("route_") or f.name == "route_transform"
]
ROUTE_COLUMNS = ["route_ids", "route_counts", "route_order", "token_ids"]


@dataclass(frozen=True)
class ShardRow:
    """One trajectory as it goes into a shard."""

    trajectory_id: str
    start: int  # first token of this segment (0 unless appended)
    group_id: str | None
    policy_version: int
    num_tokens: int  # tokens in this segment
    prompt_len: int
    routes: EncodedRoutes
    source: Source = ENGINE
    load: Any = None  # [L, E] expert counts (`r3store.logic.stats`), when computed
    writer: str | None = None  # the API key that uploaded it (the catalog's, not the shard's)

    @property
    def digest(self) -> bytes:
        """The content digest of the segment (its routes' and metadata's)."""
        return self.routes.digest


@dataclass(frozen=True)
class RowPlace:
    row_group: int
    row: int  # within the row group


@dataclass(frozen=True)
class BuiltShard:
    key: str
    data: bytes
    places: list[RowPlace]  # one per input row, in input order
    routes: list[RouteSpans]  # one per input row, in input order
    created_at: float
    rest_level: int | None = None  # the zstd level maintenance wrote it at, if it did


def _table(namespace: str, rows: Sequence[ShardRow], kinds: Sequence[str]) -> pa.Table:
    def prefix_of(r: ShardRow) -> EncodedRoutes | None:
        return r.routes.prefix

    return pa.table(
        {
            "namespace": pa.array([namespace] * len(rows), pa.string()),
            "trajectory_id": [r.trajectory_id for r in rows],
            "start": pa.array([r.start for r in rows], pa.int64()),
            "group_id": pa.array([r.group_id for r in rows], pa.string()),
            "policy_version": pa.array([r.policy_version for r in rows], pa.int64()),
            "num_tokens": pa.array([r.num_tokens for r in rows], pa.int32()),
            "prompt_len": pa.array([r.prompt_len for r in rows], pa.int32()),
            "digest": pa.array([r.digest for r in rows], pa.binary(16)),
            "route_transform": pa.array([int(r.routes.transform) for r in rows], pa.int8()),
            "route_ids": pa.array([r.routes.ids for r in rows], pa.binary()),
            "route_counts": pa.array([r.routes.counts for r in rows], pa.binary()),
            "route_order": pa.array([r.routes.order for r in rows], pa.binary()),
            "token_ids": pa.array([r.routes.tokens for r in rows], pa.binary()),
            "source": pa.array([r.source for r in rows], pa.string()),
            "kind": pa.array(kinds, pa.string()),
            "route_dictionary": pa.array([r.routes.dictionary for r in rows], pa.binary(16)),
            "prefix_digest": pa.array(
                [None if (p := prefix_of(r)) is None else p.digest for r in rows], pa.binary(16)
            ),
            "prefix_tokens": pa.array([r.routes.prefix_tokens for r in rows], pa.int32()),
        },
        schema=SCHEMA,
    )


def _with_prefixes(rows: Sequence[ShardRow]) -> tuple[list[ShardRow], list[str], list[int]]:
    """The rows to store: each shared prefix once (a `PREFIX` row, just before the first
    row that continues it), then the rows. Returns them, their kinds, and for every
    input row its index among them."""
    stored: list[ShardRow] = []
    kinds: list[str] = []
    where: list[int] = []
    seen: set[tuple[bytes, bytes | None]] = set()
    for row in rows:
        prefix = row.routes.prefix
        if prefix is not None:
            if prefix.dictionary != row.routes.dictionary or not prefix.digest:
                raise ValueError("a prefix needs a digest and its rows' dictionary")
            if (prefix.digest, prefix.dictionary) not in seen:
                seen.add((prefix.digest, prefix.dictionary))
                tokens = row.routes.prefix_tokens
                stored.append(
                    ShardRow(
                        "", 0, row.group_id, row.policy_version, tokens, tokens, prefix, row.source
                    )
                )
                kinds.append(PREFIX)
        where.append(len(stored))
        stored.append(row)
        kinds.append(SEGMENT)
    return stored, kinds, where


def build_shard(
    namespace: str,
    spec: RouteSpec,
    rows: Sequence[ShardRow],
    row_group_bytes: int,
    created: float | None = None,
    rest_level: int | None = None,
    key: str | None = None,
) -> BuiltShard:
    """Write `rows` into one Parquet file in memory (`rest_level`: written at rest), under
    `key` (default: a new one)."""
    if not rows:
        raise ValueError("a shard needs at least one row")
    created = time.time() if created is None else created
    key = shard_key(namespace, created) if key is None else key
    metadata = {
        META_FORMAT: FORMAT_VERSION.encode(),
        META_SPEC: spec.to_json().encode(),
        META_NAMESPACE: namespace.encode(),
        META_CREATED: repr(created).encode(),
    }
    if rest_level is not None:
        metadata[META_REST_LEVEL] = str(rest_level).encode()
    schema = SCHEMA.with_metadata(metadata)
    compression: dict[str | bytes, str] = {name: "ZSTD" for name in META_COLUMNS}
    compression.update({name: "NONE" for name in ROUTE_COLUMNS})
    stored, kinds, where = _with_prefixes(rows)
    stored_links = [
        Link(r.digest, None if (p := r.routes.prefix) is None else p.digest, r.routes.prefix_tokens)
        for r in stored
    ]
    sink = io.BytesIO()
    places: list[RowPlace] = []
    with pq.ParquetWriter(
        sink,
        schema,
        compression=compression,
        use_dictionary=["namespace", "group_id", "source"],
        write_statistics=["trajectory_id", "policy_version", "num_tokens"],
        data_page_size=row_group_bytes,
    ) as writer:
        start = 0
        group = 0
        while start < len(stored):
            end, size = start, 0
            while end < len(stored) and (
                end == start or size + stored[end].routes.nbytes <= row_group_bytes
            ):
                size += stored[end].routes.nbytes
                end += 1
            table = _table(namespace, stored[start:end], kinds[start:end])
            writer.write_table(table.replace_schema_metadata(metadata))
            places.extend(RowPlace(group, i) for i in range(end - start))
            start, group = end, group + 1
    data = sink.getvalue()
    spans = link_prefixes(locate_rows(data, [row.routes for row in stored]), kinds, stored_links)
    return BuiltShard(
        key, data, [places[i] for i in where], [spans[i] for i in where], created, rest_level
    )


@dataclass(frozen=True)
class Link:
    """What ties rows to the prefixes they share: a row's digest, and the digest and
    length of the prefix it continues (None and 0 when it continues none)."""

    digest: bytes
    prefix_digest: bytes | None
    prefix_tokens: int


def link_prefixes(
    spans: list[RouteSpans], kinds: Sequence[str], links: Sequence[Link]
) -> list[RouteSpans]:
    """Each row's spans with those of the `PREFIX` row it continues (the one before it,
    in file order, whose digest and dictionary are the row's prefix digest and
    dictionary)."""
    out: list[RouteSpans] = []
    prefixes: dict[tuple[bytes, bytes | None], RouteSpans] = {}
    for span, kind, link in zip(spans, kinds, links, strict=True):
        if kind == PREFIX:
            prefixes[(link.digest, span.dictionary)] = span
        elif link.prefix_digest is not None:
            prefix = prefixes.get((link.prefix_digest, span.dictionary))
            if prefix is None or link.prefix_tokens <= 0:
                raise CorruptShard("a row continues a prefix that no row before it holds")
            span = span.with_prefix(prefix, link.prefix_tokens, link.prefix_digest)
        out.append(span)
    return out


def locate(data: bytes, values: Sequence[bytes | None], start: int = 0) -> list[Span | None]:
    """Where each value of one binary column lies in the file, in row order.

    Route columns are PLAIN-encoded and uncompressed, so every value is stored verbatim
    after its 4-byte little-endian length; values of one column appear in row order.
    Each is found, with its length prefix, searching forward from the previous one. Should
    an equal byte string lie earlier (two identical tiny frames), the span points at
    bytes equal to the value, which is all a reader needs.
    """
    spans: list[Span | None] = []
    position = start
    for value in values:
        if value is None:
            spans.append(None)
            continue
        needle = len(value).to_bytes(4, "little") + value[:32]
        while True:
            at = data.find(needle, position)
            if at < 0:
                raise CorruptShard("a route value is not stored verbatim in the shard")
            if data.startswith(value, at + 4):
                break
            position = at + 1
        spans.append(Span(at + 4, len(value)))
        position = at + 4 + len(value)
    return spans


def locate_rows(data: bytes, rows: Sequence[EncodedRoutes]) -> list[RouteSpans]:
    """The byte spans of every row's route streams (rows in file order)."""
    ids = locate(data, [r.ids for r in rows], 4)
    counts = locate(data, [r.counts for r in rows], 4)
    order = locate(data, [r.order for r in rows], 4)
    tokens = locate(data, [r.tokens for r in rows], 4)
    return [
        RouteSpans(i, c, o, int(r.transform), t, r.dictionary)
        for i, c, o, t, r in zip(ids, counts, order, tokens, rows, strict=True)
        if i is not None
    ]


def shard_spec(metadata: pq.FileMetaData) -> tuple[str, RouteSpec]:
    """The namespace and route spec a shard was written with; checks the format version."""
    kv = metadata.metadata or {}
    version = kv.get(META_FORMAT, b"").decode()
    if version not in READ_VERSIONS:
        raise CorruptShard(
            f"shard format version {version!r}; this build reads {', '.join(READ_VERSIONS)}"
        )
    return kv[META_NAMESPACE].decode(), RouteSpec.from_json(kv[META_SPEC])


def places_of(metadata: pq.FileMetaData) -> list[RowPlace]:
    """Row group and row of every row, in file order."""
    out: list[RowPlace] = []
    for g in range(metadata.num_row_groups):
        out.extend(RowPlace(g, i) for i in range(metadata.row_group(g).num_rows))
    return out


@dataclass(frozen=True)
class ReadRow:
    """One segment row read back: its metadata and streams (with the shared prefix it
    continues, if any), where it lies and where its streams lie."""

    row: ShardRow
    place: RowPlace
    spans: RouteSpans


@dataclass(frozen=True)
class ReadShard:
    namespace: str
    spec: RouteSpec
    created_at: float
    rest_level: int | None  # the zstd level maintenance wrote it at, if it did
    rows: list[ReadRow]  # its segment rows in file order (prefix rows only in their spans)


def _column(table: pa.Table, name: str, default: object) -> list[Any]:
    """A column's values, or `default` for each row of a shard written before it."""
    if name in table.column_names:
        return table.column(name).to_pylist()  # type: ignore[no-any-return]
    return [default] * table.num_rows


def read_shard(data: bytes, key: str = "") -> ReadShard:
    """Parse a shard (`key` names it in errors): its metadata and every segment row."""
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        table = pf.read()
    except (pa.ArrowException, OSError) as exc:
        raise CorruptShard(f"cannot read {key}: {exc}") from exc
    metadata = pf.metadata
    namespace, spec = shard_spec(metadata)
    created = float((metadata.metadata or {}).get(META_CREATED, b"0"))
    level = (metadata.metadata or {}).get(META_REST_LEVEL)
    digests = table.column("digest").to_pylist()
    dictionaries = _column(table, "route_dictionary", None)
    prefix_digests = _column(table, "prefix_digest", None)
    prefix_tokens = _column(table, "prefix_tokens", 0)
    streams = [
        EncodedRoutes(ids, counts, order, Transform(transform), b"", tokens, dictionary)
        for ids, counts, order, transform, tokens, dictionary in zip(
            table.column("route_ids").to_pylist(),
            table.column("route_counts").to_pylist(),
            table.column("route_order").to_pylist(),
            table.column("route_transform").to_pylist(),
            table.column("token_ids").to_pylist(),
            dictionaries,
            strict=True,
        )
    ]
    kinds = _column(table, "kind", SEGMENT)
    links = [Link(*link) for link in zip(digests, prefix_digests, prefix_tokens, strict=True)]
    spans = link_prefixes(locate_rows(data, streams), kinds, links)
    by_link = {  # as `link_prefixes` keys them
        (d, s.dictionary): s for d, s, k in zip(digests, streams, kinds, strict=True) if k == PREFIX
    }
    streams = [  # each row's own digest, with the prefix it continues
        dataclasses.replace(s, digest=link.digest)
        if link.prefix_digest is None
        else dataclasses.replace(
            s,
            digest=link.digest,
            prefix=dataclasses.replace(
                by_link[(link.prefix_digest, s.dictionary)], digest=link.prefix_digest
            ),
            prefix_tokens=link.prefix_tokens,
        )
        for s, link in zip(streams, links, strict=True)
    ]
    sources = _column(table, "source", ENGINE)  # format 1 shards hold engine routes only
    meta = table.select(
        ["trajectory_id", "start", "group_id", "policy_version", "num_tokens", "prompt_len"]
    ).to_pylist()
    places = places_of(metadata)
    rows = [
        ReadRow(
            ShardRow(**meta[i], routes=streams[i], source=check_source(sources[i])),
            places[i],
            spans[i],
        )
        for i, kind in enumerate(kinds)
        if kind != PREFIX
    ]
    return ReadShard(namespace, spec, created, None if level is None else int(level), rows)
