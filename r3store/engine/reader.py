"""Batch reads: exactly the bytes of the asked trajectories, in few ranged GETs.

The catalog says where each trajectory's route streams lie in its shard. Spans of one
shard that lie close together are fetched with one ranged GET (at most
`coalesce_bytes`, skipping gaps of at most `gap_bytes`), every byte at most once; the
streams are then decoded in a thread pool. The bytes of recently written shards stay
in a bounded cache, so trainers that read what rollout workers just wrote skip the
object store.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from r3store.catalog_types import TrajectoryEntry
from r3store.logic.lru import LRU
from r3store.logic.reads import read_of
from r3store.protocol.plans import Fetched
from r3store.records import TrajectoryRead
from r3store.route_types import EncodedRoutes
from r3store.spans import ByteRange, Span
from r3store.spec import RouteSpec
from r3store.storage.dictionary import DictionaryCache
from r3store.storage.shard import BuiltShard
from r3store.storage.store.base import ObjectStore


@dataclass(frozen=True)
class ReaderConfig:
    """`ReaderConfig(threads=8, cache_bytes=128 << 20)`: cache_bytes=0 turns the cache off."""

    threads: int = 8
    cache_bytes: int = 128 << 20
    coalesce_bytes: int = 8 << 20
    gap_bytes: int = 64 << 10


def plan_ranges(spans: Iterable[Span], coalesce: int, gap: int) -> list[ByteRange]:
    """Cover `spans` with few ranges: neighbours closer than `gap` share a range of at
    most `coalesce` bytes (a single span larger than that gets its own range)."""
    ranges: list[ByteRange] = []
    for span in sorted(set(spans), key=lambda s: s.offset):
        if ranges:
            last = ranges[-1]
            if span.end <= last.end:
                continue
            if span.offset - last.end <= gap and span.end - last.start <= coalesce:
                ranges[-1] = ByteRange(last.start, span.end)
                continue
        ranges.append(ByteRange(span.offset, span.end))
    return ranges


class ShardReader:
    def __init__(self, store: ObjectStore, config: ReaderConfig) -> None:
        self._store = store
        self.config = config
        self._recent: LRU[str, bytes] = LRU(config.cache_bytes)
        self.dictionaries = DictionaryCache(store)
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="r3store-read")

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def remember(self, built: BuiltShard) -> None:
        """Keep a just-written shard's bytes for reads that follow (not one so large that
        it would push out most of the others)."""
        if len(built.data) <= self.config.cache_bytes // 2:
            self._recent.put(built.key, built.data, len(built.data))

    def _fetch(self, key: str, byte_range: ByteRange) -> bytes:
        data = self._recent.get(key)
        if data is not None:
            return data[byte_range.start : byte_range.end]
        return self._store.get(key, byte_range)

    def read(
        self,
        found: dict[str, list[TrajectoryEntry]],
        spec: RouteSpec,
        decode: bool = True,
        as_stored: bool = False,
    ) -> dict[str, TrajectoryRead]:
        """Fetch, and unless `decode` is False decode, the segments of catalog entries.
        Undecoded reads hold streams that decode alone: a segment stored with a
        dictionary or a shared prefix is encoded again without them."""
        by_shard: dict[str, list[TrajectoryEntry]] = defaultdict(list)
        namespace = ""
        for segments in found.values():
            for entry in segments:
                by_shard[entry.shard_key].append(entry)
                namespace = entry.namespace
        dictionaries = self.dictionaries.many(
            namespace, (e.spans.dictionary for items in by_shard.values() for e in items)
        )
        jobs = [
            (key, byte_range)
            for key, items in by_shard.items()
            for byte_range in plan_ranges(
                (s for e in items for s in e.spans.spans),
                self.config.coalesce_bytes,
                self.config.gap_bytes,
            )
        ]
        fetched: dict[str, Fetched] = defaultdict(Fetched)
        results = self._pool.map(lambda job: self._fetch(*job), jobs)
        for (key, byte_range), data in zip(jobs, results, strict=True):
            fetched[key].add(byte_range, data)

        def stored(entry: TrajectoryEntry) -> EncodedRoutes:
            return entry.spans.streams(fetched[entry.shard_key].slice, entry.digest)

        def finish(segments: list[TrajectoryEntry]) -> TrajectoryRead:
            encoded = [stored(e) for e in segments]
            first = segments[0]
            return read_of(
                [(e.start, e.num_tokens, e.policy_version) for e in segments],
                encoded,
                (first.trajectory_id, first.group_id, first.prompt_len),
                first.source,
                spec,
                dictionaries,
                decode,
                portable=True,
                as_stored=as_stored,
            )

        return {item.trajectory_id: item for item in self._pool.map(finish, found.values())}
