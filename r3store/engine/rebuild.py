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
from r3store.policy import NamespaceSettings
from r3store.route_types import Dictionary, EncodedRoutes
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
from r3store.storage.store.base import ObjectInfo, ObjectStore
from r3store.storage.tombstone import Dropped, read_tombstones

log = logging.getLogger(__name__)

Unit = tuple[str, str, str, int]  # a segment: namespace, trajectory id, source, start
Kept = tuple[TrajectoryEntry, EncodedRoutes]  # a row a rebuild keeps, and its routes


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
    kept: list[Kept],
    dictionary: Callable[[str, bytes | None], Dictionary | None],
) -> list[LoadRecord]:
    """The expert load of a shard's kept rows, counted from their routes; none when
    a route does not decode (the rows stay, their statistics are left out)."""
    if not kept:
        return []

    def load(e: TrajectoryEntry, stream: EncodedRoutes) -> Any:
        routes = codec.decode(
            stream, spec, e.num_tokens, dictionary(e.namespace, stream.dictionary)
        )
        return stats.expert_load(routes, spec)

    try:
        rows = [row_of(e, stream, load(e, stream)) for e, stream in kept]
        return load_records(kept[0][0].namespace, key, rows)
    except R3StoreError as exc:
        log.warning("expert load of %s not counted: %s", key, exc)
        return []


def _manifests(store: ObjectStore, report: RebuildReport) -> dict[str, NamespaceInfo]:
    """The namespaces as their manifests describe them, by name; an unreadable
    manifest is reported skipped."""
    spaces: dict[str, NamespaceInfo] = {}
    for info in store.list(NAMESPACE_PREFIX):
        try:
            space = parse_manifest(store.get(info.key))
            spaces[space.name] = space
        except (ValueError, KeyError, TypeError, R3StoreError) as exc:
            report.skipped.append(f"{info.key}: {exc}")
    return spaces


def _objects(store: ObjectStore) -> tuple[list[ObjectInfo], dict[str, list[str]]]:
    """The shards and committed blobs to read, newest first, and the keys of each blob's
    indexes (a blob with no index was never committed)."""
    indexes: dict[str, list[str]] = {}
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
    return objects, indexes


def _note_namespace(
    spaces: dict[str, NamespaceInfo], manifests: set[str], shard: ShardInfo, spec: RouteSpec
) -> None:
    """Add the shard's namespace when no manifest describes it, as old as its oldest
    shard."""
    known = spaces.get(shard.namespace)
    if known is None or (shard.namespace not in manifests and shard.created_at < known.created_at):
        spaces[shard.namespace] = NamespaceInfo(
            shard.namespace, spec, shard.created_at, 0, NamespaceSettings()
        )


@dataclass
class _Copies:
    """The copies of each segment read so far, newest shard first: the first is kept,
    with the oldest copy's shard time as when it was committed; one retention dropped
    (a tombstone names it) is left out; one with other content is reported."""

    dropped: set[Dropped]
    report: RebuildReport
    seen: dict[Unit, bytes] = field(default_factory=dict)  # the kept copy's digest
    committed: dict[Unit, float] = field(default_factory=dict)  # the oldest copy's shard time

    def keep(
        self, key: str, entries: list[TrajectoryEntry], streams: list[EncodedRoutes]
    ) -> list[Kept]:
        """The rows of shard `key` to keep."""
        kept = []
        for entry, stream in zip(entries, streams, strict=True):
            if (entry.namespace, entry.trajectory_id, entry.start, entry.digest) in self.dropped:
                self.report.dropped += 1
                continue
            unit = (entry.namespace, entry.trajectory_id, entry.source, entry.start)
            first = self.seen.get(unit)
            if first is None:
                self.seen[unit] = entry.digest
                kept.append((entry, stream))
            elif first == entry.digest:
                self.report.duplicates += 1
                self.committed[unit] = min(
                    self.committed.get(unit, entry.created_at), entry.created_at
                )
            else:
                self.report.conflicts.append(f"{entry.namespace}/{entry.trajectory_id} in {key}")
        return kept

    def as_committed(self, entry: TrajectoryEntry) -> TrajectoryEntry:
        """`entry` with its oldest copy's shard time, when an older copy was seen."""
        unit = (entry.namespace, entry.trajectory_id, entry.source, entry.start)
        if unit in self.committed and self.committed[unit] < entry.created_at:
            return dataclasses.replace(entry, created_at=self.committed[unit])
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
    spaces = _manifests(store, report)
    manifests = set(spaces)
    copies = _Copies(read_tombstones(store), report)
    dictionary = DictionaryCache(store).get
    objects, indexes = _objects(store)
    loaded: list[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]] = []
    for done, info in enumerate(objects, start=1):
        try:
            shard, spec, entries, streams = _load_shard(store, info.key, info.size, indexes)
        except R3StoreError as exc:
            log.warning("skipping %s: %s", info.key, exc)
            report.skipped.append(f"{info.key}: {exc}")
            continue
        _note_namespace(spaces, manifests, shard, spec)
        kept = copies.keep(info.key, entries, streams)
        loads = _loads(info.key, spec, kept, dictionary)
        loaded.append((shard, [entry for entry, _stream in kept], loads))
        report.trajectories += len(kept)
        if progress is not None:
            progress(done, len(objects))

    def contents() -> Iterator[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]]:
        for shard, entries, loads in reversed(loaded):  # oldest first, as written
            yield shard, [copies.as_committed(e) for e in entries], loads

    found = [parse_dictionary_key(info.key) for info in store.list(DICTIONARY_PREFIX)]
    dictionaries = [d for d in found if d is not None]
    catalog.shards.replace_all(list(spaces.values()), contents(), dictionaries)
    report.namespaces = len(spaces)
    report.shards = len(loaded)
    return report
