"""Retention, compaction and garbage collection: storage that does not grow without bound.

One pass (`Maintenance.run`), for every namespace:

1. Retention: trajectories outside the namespace's retention settings (older than both
   the last `keep_versions` policy versions and the last `keep_versions` versions that
   hold routes, so moving the policy version alone drops no more; first stored more
   than `ttl_seconds` ago; or sampled `max_times_sampled` times when
   `evict_after_sampled`) leave the catalog,
   after a tombstone naming their segments is stored (`tombstones/`), so a catalog
   rebuild does not bring them back from shards not yet compacted. Never those an open
   lease holds or that were consumed after the namespace's oldest kept checkpoint (a
   resume hands them out again: `Leases.protected`). Leases closed a day ago are
   forgotten, except those a kept checkpoint may still undo.
2. Compaction: a shard whose live route bytes fell below `compact_below` of the route
   bytes it was written with is rewritten with only its live rows (same content
   digests) under a key planned in the catalog first; the catalog switches to the new
   shard in one transaction (a `DELETE ... RETURNING` of the old rows: when any was
   dropped or moved by another pass meanwhile, the switch is refused and the new object
   deleted, so no committed shard holds a row retention dropped) and the old shard is
   retired. A shard with no live row is retired.
3. Rest: shards written more than `cold_seconds` ago are merged (up to
   `rest_shard_bytes` of routes each, oldest first; small shards already at rest join
   the next merge) and their rows encoded again at rest (`r3store.logic.rest`: the namespace's
   dictionary for their policy version, stored create-only under its digest and
   trained from the version's first cold trajectories; a high zstd level; prompt routes
   stored once per group). The catalog switches as in compaction, all merged shards at
   once.
4. Collection: retired shards' objects are deleted once retired for `grace_seconds` (so
   reads that looked up the old rows still find them), then their catalog rows; uploads
   this catalog planned and never committed (a crash between upload and commit) once
   planned more than `orphan_seconds` ago, claimed in the catalog first so that a late
   commit is refused instead; dictionaries no row names and no pass held for as long,
   marked first; deletions under way (a namespace's, a crash's) are finished. Objects
   this catalog did not plan (another catalog's) are never deleted, only reported; a
   catalog older than its store (`binding.behind`) deletes nothing. Each deletion is
   logged.

Objects are deleted only after the catalog no longer points at them. At the end of a
pass the catalog's generation counts up (`binding.advance`). The clock is injectable,
for tests.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from r3store.catalog_types import ShardUsage, TrajectoryEntry
from r3store.engine.collection import Collectible, Collection
from r3store.errors import Conflict, R3StoreError
from r3store.logic import codec, rest
from r3store.route_types import Dictionary, EncodedRoutes
from r3store.spans import Span
from r3store.spec import RouteSpec
from r3store.storage import binding
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.ledger import MAINTENANCE
from r3store.storage.dictionary import DictionaryCache, write_dictionary
from r3store.storage.keys import (
    shard_key,
    tombstone_key,
)
from r3store.storage.records import route_bytes, row_of, shard_records
from r3store.storage.shard import BuiltShard, ShardRow, build_shard
from r3store.storage.store.base import ObjectStore
from r3store.storage.tombstone import tombstone

log = logging.getLogger(__name__)

LEASE_HISTORY_SECONDS = 86400.0  # closed leases are kept this long (a late commit is told why)


def _reader(data: memoryview) -> Callable[[Span], bytes]:
    return lambda span: bytes(data[span.offset : span.end])


@dataclass
class MaintenanceReport:
    trajectories_dropped: int = 0
    trajectories_kept: int = 0  # retention's, kept for a lease or a checkpoint
    leases_forgotten: int = 0
    shards_compacted: int = 0
    shards_retired: int = 0
    objects_deleted: int = 0
    orphans_deleted: int = 0  # uploads this catalog planned and never committed
    tombstones_deleted: int = 0
    unknown_objects: int = 0  # objects this catalog did not make: left alone
    catalog_behind: int = 0  # passes that deleted nothing: the catalog is behind its store
    shards_merged: int = 0  # shards rewritten at rest (merged into `shards_at_rest`)
    shards_at_rest: int = 0
    rest_bytes_saved: int = 0  # route bytes, before minus after
    dictionaries_trained: int = 0
    live_bytes: int = 0
    dead_bytes: int = 0


@dataclass(frozen=True)
class MaintenanceOptions:
    """How maintenance passes run (the steps in the module's docstring)."""

    grace_seconds: float = 600.0  # retired shards are deleted once retired this long
    orphan_seconds: float = 3600.0  # uploads never committed are deleted once this old
    compact_below: float = 0.5  # the live share of route bytes under which a shard is rewritten
    cold_seconds: float | None = 600.0  # shards older are merged at rest; None: never
    rest_level: int = rest.REST_LEVEL  # the zstd level at rest
    rest_shard_bytes: int = 64 << 20  # the routes of one shard merged at rest, at most
    clock: Callable[[], float] = time.time


class Maintenance:
    """Passes over one store and its catalog; `Engine.upkeep.maintenance()` makes one
    for the engine's. `spec(namespace)` gives a namespace's route spec."""

    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        spec: Callable[[str], RouteSpec],
        options: MaintenanceOptions | None = None,
        *,
        row_group_bytes: int = 1 << 20,
    ) -> None:
        options = options or MaintenanceOptions()
        self.catalog = catalog
        self.store = store
        self.spec = spec
        self.row_group_bytes = row_group_bytes
        self.clock = options.clock
        self.compact_below = options.compact_below
        self.cold_seconds = options.cold_seconds
        self.rest_level = options.rest_level
        self.rest_shard_bytes = options.rest_shard_bytes
        self.totals = MaintenanceReport()
        self.passes = 0  # whole passes run
        self._dictionaries = DictionaryCache(store)
        self.collection = Collection(
            store, catalog, self.clock, options.grace_seconds, options.orphan_seconds
        )

    def run(self, progress: Callable[[int, int], None] | None = None) -> MaintenanceReport:
        """One pass; `progress(done, total)` is called per shard considered."""
        report = MaintenanceReport()
        for info in self.catalog.namespaces.all():
            report.trajectories_dropped += self.apply_retention(info.name, report)
            report.leases_forgotten += self.catalog.leases.prune(
                info.name, self.clock() - LEASE_HISTORY_SECONDS
            )
        self.compact(report, progress)
        self.settle(report, progress)
        self.collect(report)
        binding.advance(self.store, self.catalog)  # a backup older than this pass is stale
        for usage in self.catalog.shards.usage():
            report.live_bytes += usage.live_bytes
            report.dead_bytes += usage.route_bytes - usage.live_bytes
        for name in (
            "tombstones_deleted",
            "shards_merged",
            "shards_at_rest",
            "rest_bytes_saved",
            "dictionaries_trained",
            "trajectories_dropped",
            "trajectories_kept",
            "leases_forgotten",
            "shards_compacted",
            "shards_retired",
            "objects_deleted",
            "orphans_deleted",
            "unknown_objects",
            "catalog_behind",
        ):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(report, name))
        self.totals.live_bytes, self.totals.dead_bytes = report.live_bytes, report.dead_bytes
        self.passes += 1
        return report

    def _victims(self, namespace: str) -> list[str]:
        info = self.catalog.namespaces.get(namespace)
        retention = info.settings.retention
        floor = None
        if retention.keep_versions is not None:
            # the last keep_versions versions, and the last keep_versions that hold routes:
            # moving the policy version alone (a bad jump) drops nothing that the versions
            # with routes keep
            held = self.catalog.segments.newest_version(namespace, retention.keep_versions)
            if held is not None:
                floor = min(info.policy_version - retention.keep_versions + 1, held)
        cutoff = None if retention.ttl_seconds is None else self.clock() - retention.ttl_seconds
        sampled = info.settings.max_times_sampled if retention.evict_after_sampled else None
        return self.catalog.segments.retention_victims(namespace, floor, cutoff, sampled)

    def apply_retention(self, namespace: str, report: MaintenanceReport | None = None) -> int:
        victims = self._victims(namespace)
        if victims:
            kept = self.catalog.leases.protected(namespace, self.clock())
            if report is not None:
                report.trajectories_kept += sum(1 for v in victims if v in kept)
            victims = [v for v in victims if v not in kept]
        if victims:
            # the store first: a catalog rebuild must not bring these back from shards
            # that still hold them
            entries = [
                e
                for group in self.catalog.segments.lookup(namespace, victims).values()
                for e in group
            ]
            record = tombstone(namespace, entries)
            self.store.put_if_absent(tombstone_key(namespace, self.clock()), record)
            # only the segments still where the tombstone says: one a concurrent pass
            # moved into a new shard meanwhile is dropped by the next pass, with a
            # tombstone naming that shard
            # and none that a lease took since: judged again under the namespace's lock
            named = sorted({e.shard_key for e in entries})
            _, late = self.catalog.leases.drop(namespace, victims, named, self.clock)
            if report is not None:
                report.trajectories_kept += late
            log.info("retention dropped %d trajectories from %s", len(victims) - late, namespace)
            return len(victims) - late
        return 0

    def compact(
        self, report: MaintenanceReport, progress: Callable[[int, int], None] | None = None
    ) -> None:
        now = self.clock()
        usages = self.catalog.shards.usage()
        for done, usage in enumerate(usages, start=1):
            if progress is not None:
                progress(done, len(usages))
            todo = self._compaction(usage)
            if todo == RETIRE:
                if self.catalog.shards.retire_empty(usage.key, now):
                    report.shards_retired += 1
            elif todo == COMPACT:
                try:
                    self._rewrite(usage.key, usage.namespace, now)
                    report.shards_compacted += 1
                except R3StoreError as exc:  # left as it was; the next pass tries again
                    log.warning("compaction of %s failed: %s", usage.key, exc)

    def _compaction(self, usage: ShardUsage) -> str | None:
        """What compaction does with a live shard: RETIRE (no row points at it), COMPACT
        (its live bytes fell below `compact_below`), or nothing."""
        if usage.live_rows == 0:
            return RETIRE
        return COMPACT if usage.live_fraction < self.compact_below else None

    def _rewrite(self, key: str, namespace: str, now: float) -> None:
        new_key = self._plan(namespace)
        try:
            entries = self.catalog.segments.entries_in(key)
            data = self.store.get(key) if entries else b""
            read = _reader(memoryview(data))
            rows = [row_of(e, e.spans.streams(read, e.digest)) for e in entries]
            at_rest = self.catalog.shards.get(key).rest_level
        except BaseException:
            self._abandon(new_key)
            raise
        if not entries:
            self._abandon(new_key)
            return
        built = self._replace(new_key, [key], namespace, rows, now, at_rest)
        log.info("compacted %s into %s (%d rows)", key, built.key, len(rows))

    def _plan(self, namespace: str) -> str:
        """A new shard key, recorded as a planned maintenance upload before anything is
        read: tombstones of the namespace are kept while it is pending."""
        now = self.clock()
        key = shard_key(namespace, now)
        self.catalog.ledger.plan_upload(key, namespace, MAINTENANCE, now)
        return key

    def _abandon(self, key: str) -> None:
        """A planned upload that will not be committed: its object (if any) goes, then the
        plan; left to collection when the store cannot say."""
        try:
            self.store.delete(key)
            self.catalog.ledger.forget_upload(key)
        except R3StoreError as exc:
            log.warning("could not remove the abandoned upload %s (collected later): %s", key, exc)

    def _replace(
        self,
        key: str,
        old: list[str],
        namespace: str,
        rows: list[ShardRow],
        now: float,
        rest_level: int | None,
    ) -> BuiltShard:
        """Write `rows` (those `old` holds) into the planned shard `key` and point the
        catalog at it instead of `old`; each row keeps when it was stored and how often
        it was sampled, as the catalog holds them at the switch. Refused by the catalog
        (rows dropped or moved meanwhile, a dictionary collected), the new object goes
        again."""
        try:
            built = build_shard(
                namespace,
                self.spec(namespace),
                rows,
                self.row_group_bytes,
                rest_level=rest_level,
                key=key,
            )
        except BaseException:
            self._abandon(key)
            raise
        self.store.put_if_absent(built.key, built.data)
        shard, moved = shard_records(namespace, built, rows)
        try:
            self.catalog.shards.replace(old, shard, moved, now)
        except Conflict:
            self._abandon(key)
            raise
        return built

    def settle(
        self, report: MaintenanceReport, progress: Callable[[int, int], None] | None = None
    ) -> None:
        """Merge cold shards and encode their rows at rest (the module docstring, 3)."""
        batches = self._rest_batches()
        for done, batch in enumerate(batches, start=1):
            if progress is not None:
                progress(done, len(batches))
            try:
                self._settle(batch, report)
            except R3StoreError as exc:  # left as it was; the next pass tries again
                log.warning("rest encoding of %d shards failed: %s", len(batch), exc)

    def _rest_batches(self) -> list[list[ShardUsage]]:
        if self.cold_seconds is None:
            return []
        cutoff = self.clock() - self.cold_seconds
        small = self.rest_shard_bytes // 4
        by_namespace: dict[str, list[ShardUsage]] = defaultdict(list)
        for usage in self.catalog.shards.usage():
            cold = usage.live_rows and usage.created_at < cutoff
            if cold and (usage.rest_level is None or usage.live_bytes < small):
                by_namespace[usage.namespace].append(usage)
        return [b for usages in by_namespace.values() for b in self._batches(usages)]

    def _batches(self, usages: list[ShardUsage]) -> list[list[ShardUsage]]:
        """Consecutive shards (oldest first) of up to `rest_shard_bytes` of routes; a
        lone shard already at rest is left alone."""
        batches: list[list[ShardUsage]] = [[]]
        size = 0
        for usage in usages:
            if batches[-1] and size + usage.live_bytes > self.rest_shard_bytes:
                batches.append([])
                size = 0
            batches[-1].append(usage)
            size += usage.live_bytes
        return [b for b in batches if b and not (len(b) == 1 and b[0].rest_level is not None)]

    def _settle(self, batch: list[ShardUsage], report: MaintenanceReport) -> None:
        key = self._plan(batch[0].namespace)
        try:
            rows, before, after = self._encode_at_rest(batch, report)
        except BaseException:
            self._abandon(key)
            raise
        namespace, keys = batch[0].namespace, [u.key for u in batch]
        built = self._replace(key, keys, namespace, rows, self.clock(), self.rest_level)
        report.shards_merged += len(batch)
        report.shards_at_rest += 1
        report.rest_bytes_saved += before - after
        log.info("%d shards of %s at rest in %s", len(batch), namespace, built.key)

    def _encode_at_rest(
        self, batch: list[ShardUsage], report: MaintenanceReport
    ) -> tuple[list[ShardRow], int, int]:
        """The rows of `batch`'s shards encoded at rest, and their route bytes before and
        after."""
        namespace, spec = batch[0].namespace, self.spec(batch[0].namespace)
        entries: list[TrajectoryEntry] = []
        stored: list[EncodedRoutes] = []
        fresh: list[int] = []  # rows as ingest wrote them; those at rest are copied
        for usage in batch:
            data = memoryview(self.store.get(usage.key))
            held = self.catalog.segments.entries_in(usage.key)
            streams = [e.spans.streams(_reader(data), e.digest) for e in held]
            if usage.rest_level is None:  # as ingest wrote them (a direct write's may
                # name the dictionary it was encoded with, and be token-major)
                fresh += [len(stored) + i for i, s in enumerate(streams) if s.prefix is None]
            entries += held
            stored += streams
        before = sum(route_bytes(stored))
        by_version: dict[int, list[int]] = defaultdict(list)
        for i in fresh:
            by_version[entries[i].policy_version].append(i)
        for version, picked in sorted(by_version.items()):
            cold = [
                rest.ColdRow(
                    codec.decode(
                        stored[i],
                        spec,
                        entries[i].num_tokens,
                        self._dictionaries.get(namespace, stored[i].dictionary),
                    ),
                    stored[i],
                    entries[i].group_id,
                    entries[i].source,
                    entries[i].start,
                    entries[i].prompt_len,
                )
                for i in picked
            ]
            dictionary = self._dictionary(namespace, version, spec, cold, report)
            settled = rest.settle(spec, cold, dictionary, self.rest_level)
            for i, encoded in zip(picked, settled, strict=True):
                stored[i] = encoded
        rows = [row_of(e, s) for e, s in zip(entries, stored, strict=True)]
        return rows, before, sum(route_bytes(stored))

    def _dictionary(
        self,
        namespace: str,
        version: int,
        spec: RouteSpec,
        cold: list[rest.ColdRow],
        report: MaintenanceReport,
    ) -> Dictionary | None:
        """The dictionary of `version`: its own if it has one, else one trained from
        `cold` (stored first), else the newest of an earlier version, else none."""
        # each dictionary used is held in the catalog first (and again when the rows
        # commit): one being collected meanwhile is not used
        found = self.catalog.segments.dictionary_for(namespace, version)
        held = found is not None and self.catalog.ledger.hold_dictionary(
            namespace, found[0], self.clock()
        )
        if found is not None and held and found[1] == version:
            return self._dictionaries.get(namespace, found[0])
        trained = rest.train(rest.samples(spec, cold))
        # recorded before it is stored; one being deleted right now (the same bytes
        # trained before) is not used
        now = self.clock()
        if trained is not None and self.catalog.ledger.record_dictionary(
            namespace, trained.digest, version, now
        ):
            write_dictionary(self.store, namespace, trained)
            self._dictionaries.add(namespace, trained)
            report.dictionaries_trained += 1
            return trained
        return self._dictionaries.get(namespace, found[0]) if found is not None and held else None

    def collect(self, report: MaintenanceReport) -> None:
        """Collection (the module docstring, 4: `r3store.engine.collection`)."""
        done = self.collection.collect()
        for name, value in vars(done).items():
            setattr(report, name, getattr(report, name) + value)

    def collectible(self) -> Collectible:
        """What collection would delete now, and why; changes nothing."""
        return self.collection.collectible()

    def preview(self) -> MaintenancePreview:
        """What a pass would do now, changing nothing: trajectories retention would drop,
        shards compaction and rest would rewrite, objects collection would delete. A
        real pass may do more (shards retention empties are collected a grace later)."""
        preview = MaintenancePreview()
        for info in self.catalog.namespaces.all():
            victims = self._victims(info.name)
            if victims:
                preview.retention[info.name] = victims
        for usage in self.catalog.shards.usage():
            todo = self._compaction(usage)
            if todo == RETIRE:
                preview.retire.append(usage.key)
            elif todo == COMPACT:
                preview.compact.append(usage.key)
        preview.rest = [[u.key for u in batch] for batch in self._rest_batches()]
        found = self.collectible()
        preview.delete = [(d.key, d.why) for d in found.deletions]
        preview.unknown = found.unknown
        preview.behind = found.behind
        return preview


RETIRE, COMPACT = "retire", "compact"


@dataclass
class MaintenancePreview:
    """`Maintenance.preview()`: what a pass would do, as things stand."""

    retention: dict[str, list[str]] = field(default_factory=dict)  # namespace: ids
    retire: list[str] = field(default_factory=list)  # shards no row points at
    compact: list[str] = field(default_factory=list)
    rest: list[list[str]] = field(default_factory=list)  # shards merged into one, each
    delete: list[tuple[str, str]] = field(default_factory=list)  # (key, why)
    unknown: list[str] = field(default_factory=list)  # left alone: not this catalog's
    behind: str | None = None  # why nothing would be deleted (a catalog behind its store)
