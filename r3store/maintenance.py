"""Retention, compaction and garbage collection: storage that does not grow without bound.

One pass (`Maintenance.run`), for every namespace:

1. Retention: trajectories outside the namespace's retention settings (older than the
   last `keep_versions` policy versions, first stored more than `ttl_seconds` ago, or
   sampled `max_times_sampled` times when `evict_after_sampled`) leave the catalog,
   after a tombstone naming their segments is stored (`tombstones/`), so a catalog
   rebuild does not bring them back from shards not yet compacted.
2. Compaction: a shard whose live route bytes fell below `compact_below` of the route
   bytes it was written with is rewritten with only its live rows (same content
   digests); the catalog switches to the new shard in one transaction (a
   `DELETE ... RETURNING` of the old rows, so two passes at once never duplicate or
   revive a row) and the old shard is retired. A shard with no live row is retired.
3. Collection: retired shards' objects are deleted once retired for `grace_seconds` (so
   reads that looked up the old rows still find them), then their catalog rows; objects
   under `shards/` that no catalog row names (a crash between upload and commit) are
   deleted once older than `orphan_seconds`, far longer than any commit takes: a shard
   uploaded by a replica whose catalog commit is still under way is not an orphan.

Objects are deleted only after the catalog no longer points at them. The clock is
injectable, for tests.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from r3store.catalog import Catalog
from r3store.errors import ObjectNotFound, R3StoreError
from r3store.keys import SHARD_PREFIX, TOMBSTONE_PREFIX, tombstone_key
from r3store.shard import Span, build_shard
from r3store.spec import RouteSpec
from r3store.store.base import ObjectStore
from r3store.writer import row_of, shard_records


def read_tombstones(store: ObjectStore) -> set[tuple[str, str, int, bytes]]:
    """(namespace, trajectory id, start, digest) of every segment retention dropped."""
    dropped = set()
    for info in store.list(TOMBSTONE_PREFIX):
        try:
            record = json.loads(store.get(info.key))
        except ObjectNotFound:  # collected meanwhile: its shards are gone too
            continue
        for tid, start, digest in record["segments"]:
            dropped.add((record["namespace"], tid, int(start), bytes.fromhex(digest)))
    return dropped


log = logging.getLogger(__name__)


@dataclass
class MaintenanceReport:
    trajectories_dropped: int = 0
    shards_compacted: int = 0
    shards_retired: int = 0
    objects_deleted: int = 0
    orphans_deleted: int = 0
    tombstones_deleted: int = 0
    live_bytes: int = 0
    dead_bytes: int = 0


class Maintenance:
    """Passes over one store and its catalog; `Engine.maintenance()` makes one for the
    engine's. `spec(namespace)` gives a namespace's route spec."""

    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        spec: Callable[[str], RouteSpec],
        *,
        row_group_bytes: int = 1 << 20,
        clock: Callable[[], float] = time.time,
        compact_below: float = 0.5,
        grace_seconds: float = 600.0,
        orphan_seconds: float = 3600.0,
    ) -> None:
        self.catalog = catalog
        self.store = store
        self.spec = spec
        self.row_group_bytes = row_group_bytes
        self.clock = clock
        self.compact_below = compact_below
        self.grace_seconds = grace_seconds
        self.orphan_seconds = orphan_seconds
        self.totals = MaintenanceReport()

    def run(self, progress: Callable[[int, int], None] | None = None) -> MaintenanceReport:
        """One pass; `progress(done, total)` is called per shard considered."""
        report = MaintenanceReport()
        for info in self.catalog.list_namespaces():
            report.trajectories_dropped += self.apply_retention(info.name)
        self.compact(report, progress)
        self.collect(report)
        for usage in self.catalog.shard_usage():
            report.live_bytes += usage.live_bytes
            report.dead_bytes += usage.route_bytes - usage.live_bytes
        for name in (
            "tombstones_deleted",
            "trajectories_dropped",
            "shards_compacted",
            "shards_retired",
            "objects_deleted",
            "orphans_deleted",
        ):
            setattr(self.totals, name, getattr(self.totals, name) + getattr(report, name))
        self.totals.live_bytes, self.totals.dead_bytes = report.live_bytes, report.dead_bytes
        return report

    def apply_retention(self, namespace: str) -> int:
        info = self.catalog.namespace(namespace)
        retention = info.settings.retention
        floor = None
        if retention.keep_versions is not None:
            floor = info.policy_version - retention.keep_versions + 1
        cutoff = None if retention.ttl_seconds is None else self.clock() - retention.ttl_seconds
        sampled = info.settings.max_times_sampled if retention.evict_after_sampled else None
        victims = self.catalog.retention_victims(namespace, floor, cutoff, sampled)
        if victims:
            # the store first: a catalog rebuild must not bring these back from shards
            # that still hold them
            entries = [
                e for group in self.catalog.lookup(namespace, victims).values() for e in group
            ]
            record = json.dumps(
                {
                    "namespace": namespace,
                    "segments": [[e.trajectory_id, e.start, e.digest.hex()] for e in entries],
                    "shards": sorted({e.shard_key for e in entries}),
                }
            ).encode()
            self.store.put_if_absent(tombstone_key(namespace, self.clock()), record)
            self.catalog.delete_trajectories(namespace, victims)
            log.info("retention dropped %d trajectories from %s", len(victims), namespace)
        return len(victims)

    def compact(
        self, report: MaintenanceReport, progress: Callable[[int, int], None] | None = None
    ) -> None:
        now = self.clock()
        usages = self.catalog.shard_usage()
        for done, usage in enumerate(usages, start=1):
            if progress is not None:
                progress(done, len(usages))
            if usage.live_rows == 0:
                if self.catalog.retire_empty(usage.key, now):
                    report.shards_retired += 1
            elif usage.live_fraction < self.compact_below:
                try:
                    self._rewrite(usage.key, usage.namespace, now)
                    report.shards_compacted += 1
                except R3StoreError as exc:  # left as it was; the next pass tries again
                    log.warning("compaction of %s failed: %s", usage.key, exc)

    def _rewrite(self, key: str, namespace: str, now: float) -> None:
        entries = self.catalog.entries_in(key)
        if not entries:
            return
        data = self.store.get(key)
        spec = self.spec(namespace)

        def read(span: Span) -> bytes:
            return data[span.offset : span.end]

        rows = [row_of(e, e.spans.streams(read, e.digest)) for e in entries]
        built = build_shard(namespace, spec, rows, self.row_group_bytes)
        self.store.put_if_absent(built.key, built.data)
        shard, fresh = shard_records(namespace, built, rows)
        moved = [  # the rows keep when they were stored and how often they were sampled
            dataclasses.replace(new, created_at=old.created_at, times_sampled=old.times_sampled)
            for new, old in zip(fresh, entries, strict=True)
        ]
        self.catalog.replace_shard(key, shard, moved, now)
        log.info("compacted %s into %s (%d rows)", key, built.key, len(moved))

    def collect(self, report: MaintenanceReport) -> None:
        cutoff = self.clock() - self.grace_seconds
        for key in self.catalog.retired_before(cutoff):
            self.store.delete(key)
            self.catalog.forget_shard(key)
            report.objects_deleted += 1
        known = self.catalog.shard_keys()
        orphaned = self.clock() - self.orphan_seconds
        for info in self.store.list(SHARD_PREFIX):
            if info.key not in known and info.modified < orphaned:
                self.store.delete(info.key)
                report.orphans_deleted += 1
        # a tombstone matters while a shard holding its segments exists; compaction never
        # copies dropped segments, so once those shards are gone it can go too
        for info in self.store.list(TOMBSTONE_PREFIX):
            try:
                record = json.loads(self.store.get(info.key))
            except ObjectNotFound:  # another replica's pass deleted it meanwhile
                continue
            if not set(record.get("shards", [])) & known and info.modified < cutoff:
                self.store.delete(info.key)
                report.tombstones_deleted += 1
