"""The catalog's records of shard rows: what a shard written (`shard_records`), a blob
committed (`blob_records`) or either read back (`stored_records`, a catalog rebuild)
commits to the catalog, the route bytes each row is charged with (`route_bytes`), the
expert load of a shard's rows per policy version and source (`load_records`), and a
stored segment as a shard row again (`row_of`, compaction and rebuild)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from r3store.catalog_types import ShardInfo, TrajectoryEntry
from r3store.policy import Source
from r3store.records import segment_fields
from r3store.route_types import EncodedRoutes
from r3store.spans import RouteSpans
from r3store.storage.catalog.stats import LoadRecord
from r3store.storage.shard import BuiltShard, ReadShard, RowPlace, ShardRow


def route_bytes(rows: Sequence[EncodedRoutes]) -> list[int]:
    """The route bytes each row is charged with: its own streams, and a shared prefix's
    for the first row that continues it (so a shard's rows add up to all it holds)."""
    seen: set[tuple[bytes, bytes | None]] = set()
    out = []
    for routes in rows:
        n, prefix = routes.nbytes, routes.prefix
        if prefix is not None and (prefix.digest, prefix.dictionary) not in seen:
            seen.add((prefix.digest, prefix.dictionary))
            n += prefix.nbytes
        out.append(n)
    return out


def _entries(
    namespace: str,
    key: str,
    created_at: float,
    rows: Sequence[ShardRow],
    places: Sequence[RowPlace],
    spans: Sequence[RouteSpans],
) -> list[TrajectoryEntry]:
    charged = route_bytes([r.routes for r in rows])
    return [
        TrajectoryEntry(
            namespace=namespace,
            **segment_fields(row),
            digest=row.digest,
            route_bytes=nbytes,
            shard_key=key,
            row_group=place.row_group,
            row_index=place.row,
            created_at=created_at,
            spans=span,
            writer=row.writer,
        )
        for row, place, span, nbytes in zip(rows, places, spans, charged, strict=True)
    ]


def shard_records(
    namespace: str, built: BuiltShard, rows: list[ShardRow]
) -> tuple[ShardInfo, list[TrajectoryEntry]]:
    """The catalog records of a built shard and its rows (in the order they were built)."""
    entries = _entries(namespace, built.key, built.created_at, rows, built.places, built.routes)
    shard = ShardInfo(
        key=built.key,
        namespace=namespace,
        size=len(built.data),
        num_rows=len(rows),
        route_bytes=sum(e.route_bytes for e in entries),
        created_at=built.created_at,
        rest_level=built.rest_level,
    )
    return shard, entries


def blob_records(
    namespace: str,
    key: str,
    size: int,
    created_at: float,
    rows: Sequence[ShardRow],
    spans: Sequence[RouteSpans],
) -> tuple[ShardInfo, list[TrajectoryEntry]]:
    """The catalog records of rows committed from a blob (`size` bytes under `key`),
    whose streams lie at `spans`."""
    places = [RowPlace(0, i) for i in range(len(rows))]
    entries = _entries(namespace, key, created_at, rows, places, spans)
    shard = ShardInfo(
        key=key,
        namespace=namespace,
        size=size,
        num_rows=len(entries),
        route_bytes=sum(e.route_bytes for e in entries),
        created_at=created_at,
    )
    return shard, entries


def stored_records(key: str, size: int, read: ReadShard) -> tuple[ShardInfo, list[TrajectoryEntry]]:
    """The catalog records of a shard read back (`size` bytes under `key`)."""
    entries = _entries(
        read.namespace,
        key,
        read.created_at,
        [r.row for r in read.rows],
        [r.place for r in read.rows],
        [r.spans for r in read.rows],
    )
    shard = ShardInfo(
        key=key,
        namespace=read.namespace,
        size=size,
        num_rows=len(entries),
        route_bytes=sum(e.route_bytes for e in entries),
        created_at=read.created_at,
        rest_level=read.rest_level,
    )
    return shard, entries


def load_records(namespace: str, key: str, rows: Sequence[ShardRow]) -> list[LoadRecord]:
    """The expert load of a shard's rows, summed per policy version and source."""
    summed: dict[tuple[int, Source], tuple[int, Any]] = {}
    for row in rows:
        if row.load is None:
            continue
        unit = (row.policy_version, row.source)
        tokens, counts = summed.get(unit, (0, 0))
        summed[unit] = (tokens + row.num_tokens, counts + row.load)
    return [
        LoadRecord(namespace, key, version, source, tokens, counts)
        for (version, source), (tokens, counts) in sorted(summed.items())
    ]


def row_of(entry: TrajectoryEntry, routes: EncodedRoutes, load: Any = None) -> ShardRow:
    """A stored segment as a shard row again (compaction, rebuild): its entry's
    metadata and its stored streams."""
    return ShardRow(**segment_fields(entry), routes=routes, load=load, writer=entry.writer)
