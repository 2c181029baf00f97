"""Rebuild the catalog from the object store alone (the store is the source of truth)."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from r3store.catalog_types import NamespaceInfo, ShardInfo, TrajectoryEntry
from r3store.errors import R3StoreError
from r3store.logic import codec, stats
from r3store.logic.codec import Dictionary, EncodedRoutes
from r3store.policy import NamespaceSettings
from r3store.spec import RouteSpec
from r3store.storage.blob import read_blob
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.stats import LoadRecord
from r3store.storage.dictionary import DictionaryCache
from r3store.storage.keys import (
    DICTIONARY_PREFIX,
    INDEX_PREFIX,
    NAMESPACE_PREFIX,
    SHARD_PREFIX,
    blob_of_index,
    is_blob,
    parse_dictionary_key,
)
from r3store.storage.manifest import parse_manifest
from r3store.storage.records import load_records, row_of, stored_records
from r3store.storage.shard import read_shard
from r3store.storage.store.base import ObjectStore
from r3store.storage.tombstone import read_tombstones

log = logging.getLogger(__name__)


@dataclass
class RebuildReport:
    namespaces: int = 0
    shards: int = 0
    trajectories: int = 0
    duplicates: int = 0  # same id and content in more than one shard: kept once
    dropped: int = 0  # segments retention dropped (tombstones) still in shards: left out
    conflicts: list[str] = field(default_factory=list)  # same id, other content: newest kept
    skipped: list[str] = field(default_factory=list)  # unreadable objects


def _load_shard(
    store: ObjectStore, key: str, size: int, indexes: dict[str, list[str]]
) -> tuple[ShardInfo, RouteSpec, list[TrajectoryEntry], list[EncodedRoutes]]:
    """A Parquet shard's rows, or a blob's as its indexes name them."""
    if is_blob(key):
        read = read_blob(key, store.get(key), [(k, store.get(k)) for k in indexes[key]])
    else:
        read = read_shard(store.get(key), key)
    shard, entries = stored_records(key, size, read)
    return shard, read.spec, entries, [r.row.routes for r in read.rows]


def _loads(
    key: str,
    spec: RouteSpec,
    kept: list[tuple[TrajectoryEntry, EncodedRoutes]],
    dictionary: Callable[[str, bytes | None], Dictionary | None],
) -> list[LoadRecord]:
    """The expert load of a shard's kept rows, counted from their routes."""
    if not kept:
        return []

    def load(e: TrajectoryEntry, stream: EncodedRoutes) -> Any:
        routes = codec.decode(
            stream, spec, e.num_tokens, dictionary(e.namespace, stream.dictionary)
        )
        return stats.expert_load(routes, spec)

    rows = [row_of(e, stream, load(e, stream)) for e, stream in kept]
    return load_records(kept[0][0].namespace, key, rows)


def _committed(
    entry: TrajectoryEntry, committed: dict[tuple[str, str, str, int], float]
) -> TrajectoryEntry:
    key = (entry.namespace, entry.trajectory_id, entry.source, entry.start)
    if key in committed and committed[key] < entry.created_at:
        return dataclasses.replace(entry, created_at=committed[key])
    return entry


def rebuild_catalog(
    store: ObjectStore,
    catalog: Catalog,
    progress: Callable[[int, int], None] | None = None,
) -> RebuildReport:
    """Replace the catalog's content with what the shards and namespace manifests hold
    (a direct write's blob holds the rows its indexes name; one with none was never
    committed).

    Shards are read newest first (their keys are time-ordered): a segment found in
    several shards (compaction or compression at rest wrote it again, and the old shard
    is not yet deleted) keeps its newest copy and the oldest shard's time as when it
    was committed; of a segment with other content in another shard, the newest is kept
    and the others reported. Namespace settings and policy versions come
    from the manifests; sampling counts start again at zero. `progress(done, total)` is
    called per shard.
    """
    report = RebuildReport()
    spaces: dict[str, NamespaceInfo] = {}
    for info in store.list(NAMESPACE_PREFIX):
        try:
            space = parse_manifest(store.get(info.key))
            spaces[space.name] = space
        except (ValueError, KeyError, TypeError, R3StoreError) as exc:
            report.skipped.append(f"{info.key}: {exc}")
    manifests = set(spaces)
    dropped = read_tombstones(store)
    dictionary = DictionaryCache(store).get

    indexes: dict[str, list[str]] = {}  # a blob with no index was never committed
    for info in store.list(INDEX_PREFIX):
        blob = blob_of_index(info.key)
        if blob is not None:
            indexes.setdefault(blob, []).append(info.key)
    objects = [
        info
        for info in store.list(SHARD_PREFIX)
        if info.key.endswith(".parquet") or info.key in indexes
    ]
    objects.sort(key=lambda info: info.key, reverse=True)
    loaded: list[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]] = []
    seen: dict[tuple[str, str, str, int], bytes] = {}
    committed: dict[tuple[str, str, str, int], float] = {}  # the oldest copy's shard time
    for done, info in enumerate(objects, start=1):
        try:
            shard, spec, entries, streams = _load_shard(store, info.key, info.size, indexes)
        except R3StoreError as exc:
            log.warning("skipping %s: %s", info.key, exc)
            report.skipped.append(f"{info.key}: {exc}")
            continue
        known = spaces.get(shard.namespace)
        if known is None or (
            shard.namespace not in manifests and shard.created_at < known.created_at
        ):
            spaces[shard.namespace] = NamespaceInfo(  # no manifest: as old as its oldest shard
                shard.namespace, spec, shard.created_at, 0, NamespaceSettings()
            )
        kept = []
        for entry, stream in zip(entries, streams, strict=True):
            if (entry.namespace, entry.trajectory_id, entry.start, entry.digest) in dropped:
                report.dropped += 1
                continue
            key = (entry.namespace, entry.trajectory_id, entry.source, entry.start)
            first = seen.get(key)
            if first is None:
                seen[key] = entry.digest
                kept.append((entry, stream))
            elif first == entry.digest:
                report.duplicates += 1
                committed[key] = min(committed.get(key, entry.created_at), entry.created_at)
            else:
                report.conflicts.append(f"{entry.namespace}/{entry.trajectory_id} in {info.key}")
        try:
            loads = _loads(info.key, spec, kept, dictionary)
        except R3StoreError as exc:  # the rows stay; their statistics are left out
            log.warning("expert load of %s not counted: %s", info.key, exc)
            loads = []
        loaded.append((shard, [entry for entry, _stream in kept], loads))
        report.trajectories += len(kept)
        if progress is not None:
            progress(done, len(objects))

    def contents() -> Iterator[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]]:
        for shard, entries, loads in reversed(loaded):  # oldest first, as written
            yield shard, [_committed(e, committed) for e in entries], loads

    found = [parse_dictionary_key(info.key) for info in store.list(DICTIONARY_PREFIX)]
    dictionaries = [d for d in found if d is not None]
    catalog.shards.replace_all(list(spaces.values()), contents(), dictionaries)
    report.namespaces = len(spaces)
    report.shards = len(loaded)
    return report
