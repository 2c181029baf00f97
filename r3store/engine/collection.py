"""Collection, the last step of a maintenance pass: deleting what no one points at.

Retired shards' objects go once retired for `grace_seconds` (reads that looked up the
old rows still find them meanwhile), then their catalog rows; uploads this catalog
planned and never committed once planned more than `orphan_seconds` ago, claimed in the
catalog first so that a late commit is refused instead; index objects whose blob is
gone; dictionaries no row names and no pass held for as long, marked first; tombstones
no shard or upload may need; deletions under way (a namespace's, a crash's) are
finished. Objects this catalog did not plan (another catalog's) are never deleted,
only reported; a catalog older than its store (`binding.behind`) deletes nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from r3store.storage import binding
from r3store.storage.catalog import Catalog, ledger
from r3store.storage.catalog.ledger import MAINTENANCE, PlannedUpload
from r3store.storage.keys import (
    DICTIONARY_PREFIX,
    INDEX_PREFIX,
    SHARD_PREFIX,
    TOMBSTONE_PREFIX,
    blob_of_index,
    dictionary_key,
)
from r3store.storage.store.base import ObjectInfo, ObjectStore
from r3store.storage.tombstone import read_tombstone

log = logging.getLogger("r3store.engine.maintenance")  # a step of its pass, logged as one

RETIRED, ORPHAN, DICTIONARY, TOMBSTONE = "retired", "orphan", "dictionary", "tombstone"
DELETING, INDEX = "deleting", "index"


@dataclass(frozen=True)
class Deletion:
    key: str
    kind: str  # RETIRED, ORPHAN, DICTIONARY, TOMBSTONE, DELETING or INDEX
    why: str
    dictionary: tuple[str, bytes] = ("", b"")  # a dictionary's namespace and digest


@dataclass
class Collectible:
    deletions: list[Deletion] = field(default_factory=list)
    unknown: list[str] = field(default_factory=list)  # objects this catalog did not make
    stale_plans: list[str] = field(default_factory=list)  # planned, never uploaded
    behind: str | None = None  # why this catalog is older than its store: deletes nothing


@dataclass
class Collected:
    """What one collection did."""

    objects_deleted: int = 0  # retired shards and indexes of gone blobs
    tombstones_deleted: int = 0
    orphans_deleted: int = 0  # uploads this catalog planned and never committed
    unknown_objects: int = 0  # objects this catalog did not make: left alone
    catalog_behind: int = 0  # 1: deleted nothing, the catalog is behind its store


@dataclass(frozen=True)
class _Snapshot:
    """The store's listing, then the catalog's pending uploads, then what it has
    committed, read in that order: an object listed was planned before the listing, so
    it is pending at the second read or committed by the third (a commit in between
    cannot look unknown)."""

    now: float
    shards: list[ObjectInfo]
    dictionaries: list[ObjectInfo]
    pending: dict[str, PlannedUpload]
    known: set[str]
    recorded: set[str]


@dataclass(eq=False)
class Collection:
    """Collection over one store and its catalog, with a maintenance pass's clock."""

    store: ObjectStore
    catalog: Catalog
    clock: Callable[[], float]
    grace_seconds: float
    orphan_seconds: float

    def collect(self) -> Collected:
        """Delete what `collectible` names, each deletion logged; objects this catalog
        did not make are left alone and reported."""
        done = Collected()
        found = self.collectible()
        if found.behind is not None:
            log.error("maintenance deletes nothing: %s", found.behind)
            done.catalog_behind = 1
            return done
        for deletion in found.deletions:
            if not self._claim(deletion):
                continue  # a commit or another pass took it meanwhile
            self.store.delete(deletion.key)
            self._forget(deletion)
            if deletion.kind in (RETIRED, INDEX):
                done.objects_deleted += 1
            elif deletion.kind == TOMBSTONE:
                done.tombstones_deleted += 1
            else:
                done.orphans_deleted += 1
            level = logging.WARNING if deletion.kind == ORPHAN else logging.INFO
            log.log(level, "deleted %s: %s", deletion.key, deletion.why)
        for plan in found.stale_plans:  # planned, never uploaded: nothing to delete
            self.catalog.ledger.forget_upload(plan)
        done.unknown_objects = len(found.unknown)
        if found.unknown:
            log.warning(
                "%d objects this catalog did not write are left alone (e.g. %s): another "
                "catalog's, or this catalog is older than the store (restored from a "
                "backup?); `r3store rebuild --yes` makes the catalog again from the store",
                len(found.unknown),
                ", ".join(found.unknown[:3]),
            )
        return done

    def _claim(self, deletion: Deletion) -> bool:
        """Mark an object as being deleted in the catalog, in the statement that checks
        it may go (a late commit of an orphan, a pass holding a dictionary meanwhile,
        wins instead); it stays marked until `_forget`, so a failure between leaves it
        to the next pass, never unknown."""
        cutoff = self.clock() - self.orphan_seconds
        if deletion.kind == ORPHAN:
            return self.catalog.ledger.claim_orphan(deletion.key, cutoff)
        if deletion.kind == DICTIONARY:
            namespace, digest = deletion.dictionary
            return self.catalog.ledger.start_dropping_dictionary(namespace, digest, cutoff)
        return True

    def _forget(self, deletion: Deletion) -> None:
        if deletion.kind == RETIRED:
            self.catalog.shards.forget(deletion.key)
        elif deletion.kind in (ORPHAN, DELETING):
            self.catalog.ledger.forget_upload(deletion.key)
        elif deletion.kind == DICTIONARY:
            self.catalog.ledger.forget_dictionary(*deletion.dictionary)

    def collectible(self) -> Collectible:
        """What collection would delete now, and why; changes nothing (`r3store maintain
        --dry-run` shows it). Nothing, and why, for a catalog older than its store."""
        now = self.clock()
        found = Collectible(behind=binding.behind(self.store, self.catalog))
        if found.behind is not None:
            return found
        for key in self.catalog.shards.retired_before(now - self.grace_seconds):
            found.deletions.append(Deletion(key, RETIRED, "retired for over the grace"))
        seen = _Snapshot(
            now=now,
            shards=list(self.store.list(SHARD_PREFIX)),
            dictionaries=list(self.store.list(DICTIONARY_PREFIX)),
            pending={p.key: p for p in self.catalog.ledger.pending_uploads()},
            known=self.catalog.shards.all_keys(),
            recorded=self.catalog.ledger.dictionary_keys(),
        )
        for under_way in seen.pending.values():  # deletions begun (a namespace's, a crash's)
            if under_way.kind == ledger.DELETING:
                why = "its deletion was under way"
                found.deletions.append(Deletion(under_way.key, DELETING, why))
        listed = self._uploads(seen, found)
        self._indexes(seen, listed, found)
        self._dictionaries(seen, found)
        self._tombstones(seen, found)
        return found

    def _uploads(self, seen: _Snapshot, found: Collectible) -> set[str]:
        """Shard and blob objects neither committed nor being deleted: orphans once
        planned long enough ago, unknown when never planned here. The keys listed."""
        now, orphaned = seen.now, seen.now - self.orphan_seconds
        listed = set()
        for info in seen.shards:
            listed.add(info.key)
            plan = seen.pending.get(info.key)
            if info.key in seen.known or (plan is not None and plan.kind == ledger.DELETING):
                continue
            if plan is None:
                found.unknown.append(info.key)
            elif plan.planned_at < orphaned and info.modified < orphaned:
                age = now - plan.planned_at
                why = f"a {plan.kind} upload planned {age:.0f} s ago, never committed"
                found.deletions.append(Deletion(info.key, ORPHAN, why))
        found.stale_plans = [
            p.key
            for p in seen.pending.values()
            if p.key not in listed and p.planned_at < orphaned and p.kind != ledger.DELETING
        ]
        return listed

    def _indexes(self, seen: _Snapshot, listed: set[str], found: Collectible) -> None:
        """A blob's index outlives it no longer than the grace."""
        cutoff = seen.now - self.grace_seconds
        for info in self.store.list(INDEX_PREFIX):
            blob = blob_of_index(info.key)
            if blob is None:
                found.unknown.append(info.key)
            elif blob not in listed and info.modified < cutoff:
                why = "the blob it indexes is gone"
                found.deletions.append(Deletion(info.key, INDEX, why))

    def _dictionaries(self, seen: _Snapshot, found: Collectible) -> None:
        orphaned = seen.now - self.orphan_seconds
        for namespace, digest in self.catalog.ledger.unused_dictionaries(orphaned):
            key = dictionary_key(namespace, digest)
            found.deletions.append(
                Deletion(key, DICTIONARY, "a dictionary no row names", (namespace, digest))
            )
        found.unknown += [
            info.key
            for info in seen.dictionaries
            if info.key not in seen.recorded and info.key not in seen.pending
        ]

    def _tombstones(self, seen: _Snapshot, found: Collectible) -> None:
        """A tombstone matters while an object that may hold its segments exists: a
        shard it names, or a maintenance upload of its namespace not committed (which
        may hold copies of them); compaction and rest never commit dropped segments."""
        cutoff = seen.now - self.grace_seconds
        copying = {p.namespace for p in seen.pending.values() if p.kind in (MAINTENANCE, DELETING)}
        for info in self.store.list(TOMBSTONE_PREFIX):
            record = read_tombstone(self.store, info.key)
            if record is None:  # another replica's pass deleted it meanwhile
                continue
            held = set(record.shards) & seen.known or record.namespace in copying
            if not held and info.modified < cutoff:
                why = "no shard or upload that may hold its segments is left"
                found.deletions.append(Deletion(info.key, TOMBSTONE, why))
