"""Batch reads: each needed row group fetched once, decoded in a thread pool.

Footers are cached per shard (they are small and shards are immutable); the bytes of
recently written shards stay in a bounded cache so trainers that read what rollout
workers just wrote skip the object store.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Generic, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq

from r3store import codec
from r3store.catalog import Catalog, ShardInfo, TrajectoryEntry
from r3store.codec import EncodedRoutes, Transform
from r3store.records import TrajectoryRead
from r3store.shard import (
    BuiltShard,
    footer_range,
    parse_footer,
    read_row_group,
    row_group_range,
    row_routes,
)
from r3store.spec import RouteSpec
from r3store.store.base import ByteRange, ObjectStore

K = TypeVar("K")
V = TypeVar("V")


class _LRU(Generic[K, V]):
    """A thread-safe LRU bounded by the summed weight of its values."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[K, tuple[V, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def get(self, key: K) -> V | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: K, value: V, weight: int = 1) -> None:
        if weight > self.capacity:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._items[key] = (value, weight)
            self._weight += weight
            while self._weight > self.capacity:
                _key, (_value, w) = self._items.popitem(last=False)
                self._weight -= w


@dataclass(frozen=True)
class ReaderConfig:
    """`ReaderConfig(threads=8, cache_bytes=128 << 20)`: cache_bytes=0 turns the cache off."""

    threads: int = 8
    cache_bytes: int = 128 << 20
    footer_cache: int = 4096
    coalesce_bytes: int = 8 << 20


class ShardReader:
    def __init__(self, store: ObjectStore, catalog: Catalog, config: ReaderConfig) -> None:
        self._store = store
        self._catalog = catalog
        self._footers: _LRU[str, pq.FileMetaData] = _LRU(config.footer_cache)
        self._recent: _LRU[str, bytes] = _LRU(config.cache_bytes)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="r3store-read")
        self._coalesce = config.coalesce_bytes

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def remember(self, built: BuiltShard) -> None:
        """Keep a just-written shard's bytes for reads that follow."""
        self._recent.put(built.key, built.data, len(built.data))

    def _footer(self, shard: ShardInfo) -> pq.FileMetaData:
        metadata = self._footers.get(shard.key)
        if metadata is None:
            data = self._recent.get(shard.key)
            span = footer_range(shard.size, shard.footer_length)
            tail = data[span.start :] if data is not None else self._store.get(shard.key, span)
            metadata = parse_footer(tail)
            self._footers.put(shard.key, metadata)
        return metadata

    def _fetch(self, shard: ShardInfo, span: ByteRange) -> bytes:
        data = self._recent.get(shard.key)
        if data is not None:
            return data[span.start : span.end]
        return self._store.get(shard.key, span)

    def _runs(self, metadata: pq.FileMetaData, groups: list[int]) -> list[list[int]]:
        """Split sorted row-group indexes into runs of neighbours, each at most
        `coalesce_bytes` (one ranged GET a run: fewer, larger requests)."""
        runs: list[list[int]] = []
        for group in groups:
            if runs and runs[-1][-1] == group - 1:
                first = row_group_range(metadata, runs[-1][0])
                if row_group_range(metadata, group).end - first.start <= self._coalesce:
                    runs[-1].append(group)
                    continue
            runs.append([group])
        return runs

    def read(
        self, entries: Iterable[TrajectoryEntry], spec: RouteSpec, decode: bool = True
    ) -> dict[str, TrajectoryRead]:
        """Read the routes of catalog entries: one ranged GET per run of neighbouring
        row groups, each needed row group fetched once, decoded in the thread pool."""
        by_group: dict[tuple[str, int], list[TrajectoryEntry]] = defaultdict(list)
        for entry in entries:
            by_group[(entry.shard_key, entry.row_group)].append(entry)
        shards = self._catalog.shards_of(key for key, _ in by_group)
        # footers first, one fetch per shard, so row-group tasks never race for them
        footers = dict(zip(shards, self._pool.map(self._footer, shards.values()), strict=True))
        columns = ["route_transform", "route_ids", "route_counts", "route_order"]

        def task(key: str, run: list[int]) -> list[TrajectoryRead]:
            shard, metadata = shards[key], footers[key]
            first = row_group_range(metadata, run[0])
            span = ByteRange(first.start, row_group_range(metadata, run[-1]).end)
            data = self._fetch(shard, span)
            out = []
            for group in run:
                part = row_group_range(metadata, group)
                chunk = data[part.start - span.start : part.end - span.start]
                table = read_row_group(metadata, shard.size, group, chunk, columns)
                out.extend(self._rows(table, by_group[(key, group)], spec, decode))
            return out

        jobs: list[tuple[str, list[int]]] = []
        for key in shards:
            groups = sorted(g for k, g in by_group if k == key)
            jobs.extend((key, run) for run in self._runs(footers[key], groups))
        found: dict[str, TrajectoryRead] = {}
        for items in self._pool.map(lambda job: task(*job), jobs):
            for item in items:
                found[item.trajectory_id] = item
        return found

    @staticmethod
    def _rows(
        table: pa.Table, wanted: list[TrajectoryEntry], spec: RouteSpec, decode: bool
    ) -> list[TrajectoryRead]:
        out = []
        for entry in wanted:
            streams = row_routes(table, entry.row_index)
            routes = codec.decode(streams, spec, entry.num_tokens) if decode else None
            encoded = None
            if not decode:
                ids, counts, order, transform = streams
                encoded = EncodedRoutes(ids, counts, order, Transform(transform), entry.digest)
            out.append(
                TrajectoryRead(
                    trajectory_id=entry.trajectory_id,
                    group_id=entry.group_id,
                    policy_version=entry.policy_version,
                    num_tokens=entry.num_tokens,
                    prompt_len=entry.prompt_len,
                    routes=routes,
                    encoded=encoded,
                )
            )
        return out
