"""Group commit: many callers' trajectories packed into one shard per commit.

Callers validate and encode in their own threads, then `submit` a unit (one `put` call's
rows) and wait on its future. Committer threads (`committers`, so that one shard's
upload overlaps the next one's packing) each take the oldest pending units of one
namespace, up to `shard_bytes`; each checks ids against the catalog, records the shard's
key as a planned upload (only such an upload, never committed, is an orphan maintenance
may delete), writes the shard with a create-only put, commits the catalog rows in one
transaction, and only then resolves the futures. A unit whose ids are in another
committer's hands waits for that commit, so racing puts of one id are settled by the
catalog check, never by two shards. When another replica commits one of the ids first,
the catalog refuses the whole shard: the units are settled again one by one (same
content: acknowledged as a duplicate; other content: that unit alone gets `Conflict`)
and the rest go into a new shard. A unit is all-or-nothing. Pending bytes are bounded by
`buffer_bytes`: a caller waits for room, then gets `Backpressure`.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

from r3store.engine.settling import RowKey, as_segment, known_segments, row_key, settle_rows
from r3store.errors import (
    Backpressure,
    Conflict,
    PlanGone,
    R3StoreError,
    StoreError,
)
from r3store.records import PutResult
from r3store.spans import RouteSpans
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.ledger import DIRECT, INGEST
from r3store.storage.records import blob_records, load_records, shard_records
from r3store.storage.shard import BuiltShard, ShardRow, build_shard
from r3store.storage.store.base import ObjectStore

log = logging.getLogger(__name__)
_RACES = 4  # commits of one batch that may lose a race to another replica


@dataclass(frozen=True)
class WriterConfig:
    """`WriterConfig(shard_bytes=64 << 20, commit_interval=0.0)`.

    With `commit_interval=0` the committer starts as soon as it is free: one caller
    alone commits at once, and under load the puts that arrive during a commit share
    the next shard, so shards grow with the load. A positive interval waits that long
    for company (bigger shards, more latency).
    """

    shard_bytes: int = 64 << 20
    row_group_bytes: int = 1 << 20
    commit_interval: float = 0.0
    buffer_bytes: int = 256 << 20
    put_timeout: float = 30.0  # waiting for buffer room, then `Backpressure`
    commit_timeout: float = 60.0  # waiting for the commit, then `StoreError` (retry)
    committers: int = 2


@dataclass(eq=False)
class _Unit:
    namespace: str
    spec: RouteSpec
    rows: list[ShardRow]
    nbytes: int
    future: Future[list[PutResult]] = field(default_factory=Future)
    enqueued: float = field(default_factory=time.monotonic)


@dataclass(eq=False, kw_only=True)
class _Stored(_Unit):
    """A direct write's unit: its rows' streams lie in the planned blob `key`."""

    key: str
    size: int
    where: dict[RowKey, RouteSpans]
    index: Callable[[list[ShardRow], list[RouteSpans]], str]


_U = TypeVar("_U", bound=_Unit)


@dataclass
class WriterStats:
    pending_bytes: int = 0
    shards_written: int = 0
    rows_written: int = 0
    bytes_written: int = 0
    commit_seconds_total: float = 0.0


class GroupCommitter:
    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        config: WriterConfig,
        on_shard: Callable[[BuiltShard], None] | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._clock = clock
        self._store = store
        self._catalog = catalog
        self.config = config
        self._on_shard = on_shard
        self._pending: deque[_Unit] = deque()
        self._cond = threading.Condition()
        self._closing = False
        self._flush_waiters = 0
        self._active = 0
        self._inflight: set[tuple[str, str]] = set()
        self._stored: deque[_Stored] = deque()  # direct writes' units waiting to commit
        self._leading: set[str] = set()  # namespaces whose direct units are committing
        self.stats = WriterStats()
        self._threads = [
            threading.Thread(target=self._run, name=f"r3store-committer-{i}", daemon=True)
            for i in range(max(1, config.committers))
        ]
        for thread in self._threads:
            thread.start()

    def submit(
        self, namespace: str, spec: RouteSpec, rows: list[ShardRow]
    ) -> Future[list[PutResult]]:
        """Queue one all-or-nothing unit; waits up to `put_timeout` for buffer room."""
        unit = _Unit(namespace, spec, rows, sum(r.routes.nbytes for r in rows))
        deadline = time.monotonic() + self.config.put_timeout
        with self._cond:
            while (
                self.stats.pending_bytes > 0
                and self.stats.pending_bytes + unit.nbytes > self.config.buffer_bytes
            ):
                if self._closing:
                    raise R3StoreError("the engine is closing")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise Backpressure(
                        f"write buffer full ({self.stats.pending_bytes} of "
                        f"{self.config.buffer_bytes} bytes pending)",
                        retry_after=max(self.config.commit_interval * 4, 0.5),
                    )
                self._cond.wait(left)
            if self._closing:
                raise R3StoreError("the engine is closing")
            self._pending.append(unit)
            self.stats.pending_bytes += unit.nbytes
            self._cond.notify_all()
        return unit.future

    def flush(self) -> None:
        """Commit everything pending now and wait until it is committed."""
        with self._cond:
            self._flush_waiters += 1
            self._cond.notify_all()
            try:
                while self._pending or self._active:
                    self._cond.wait(0.1)
            finally:
                self._flush_waiters -= 1

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        for thread in self._threads:
            thread.join()

    def _ready(self) -> list[_Unit]:
        """Pending units whose ids no committer holds now (caller holds the lock)."""
        return [
            unit
            for unit in self._pending
            if not any((unit.namespace, row.trajectory_id) in self._inflight for row in unit.rows)
        ]

    def _take(self) -> list[_Unit] | None:
        with self._cond:
            while not self._ready():
                if self._closing and not self._pending:
                    return None
                self._cond.wait(0.5)
            while self._pending and not (self._closing or self._flush_waiters):
                if self.stats.pending_bytes >= self.config.shard_bytes:
                    break
                left = self._pending[0].enqueued + self.config.commit_interval - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            ready = self._ready()
            if not ready:
                return []
            namespace = ready[0].namespace
            batch: list[_Unit] = []
            size = 0
            for unit in ready:
                if unit.namespace != namespace:
                    continue
                if batch and size + unit.nbytes > self.config.shard_bytes:
                    break
                batch.append(unit)
                size += unit.nbytes
            for unit in batch:
                self._pending.remove(unit)
                self._inflight.update((namespace, row.trajectory_id) for row in unit.rows)
            self._active += 1
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            if batch:
                self._process(batch)
            del batch  # not kept alive (its routes are large) while the next one is awaited

    def _process(self, batch: list[_Unit]) -> None:
        try:
            self._commit(batch)
        except BaseException as exc:
            log.exception("commit of %d units failed", len(batch))
            error = exc if isinstance(exc, R3StoreError) else R3StoreError(f"commit failed: {exc}")
            for unit in batch:
                if not unit.future.done():
                    unit.future.set_exception(error)
        finally:
            with self._cond:
                self.stats.pending_bytes -= sum(u.nbytes for u in batch)
                for unit in batch:
                    self._inflight.difference_update(
                        (unit.namespace, row.trajectory_id) for row in unit.rows
                    )
                self._active -= 1
                self._cond.notify_all()

    def _commit(self, batch: list[_Unit]) -> None:
        started = time.monotonic()
        namespace, spec = batch[0].namespace, batch[0].spec
        accepted = self._settle(batch)
        for _attempt in range(_RACES):
            to_write = [row for _unit, rows, _results in accepted for row in rows]
            if not to_write:
                break
            built = build_shard(
                namespace, spec, to_write, self.config.row_group_bytes, created=self._clock()
            )
            # planned first: an upload the catalog never hears of is never collected
            self._catalog.ledger.plan_upload(built.key, namespace, INGEST, self._clock())
            self._store.put_if_absent(built.key, built.data)
            shard, entries = shard_records(namespace, built, to_write)
            try:
                loads = load_records(namespace, built.key, to_write)
                self._catalog.shards.commit(shard, entries, loads)
            except Conflict:
                # another replica committed some of these ids first: the shard is an
                # orphan nobody points at; settle every unit again, each on its own
                with contextlib.suppress(R3StoreError):
                    self._store.delete(built.key)
                    self._catalog.ledger.forget_upload(built.key)
                accepted = self._settle([unit for unit, _rows, _results in accepted])
                continue
            if self._on_shard is not None:
                self._on_shard(built)
            with self._cond:
                self.stats.shards_written += 1
                self.stats.rows_written += len(to_write)
                self.stats.bytes_written += len(built.data)
            break
        else:
            raise Conflict(f"commits to {namespace!r} kept racing other writers; retry")
        with self._cond:
            self.stats.commit_seconds_total += time.monotonic() - started
        for unit, _rows, results in accepted:
            unit.future.set_result(results)

    def commit_stored(
        self,
        namespace: str,
        spec: RouteSpec,
        key: str,
        size: int,
        rows: list[ShardRow],
        spans: list[RouteSpans],
        index: Callable[[list[ShardRow], list[RouteSpans]], str],
    ) -> list[PutResult]:
        """Commit rows whose streams are stored already, at `spans` of the planned
        object `key` of `size` bytes (a direct write's blob), as one all-or-nothing unit;
        returns once it is committed. Units that arrive together share their commit:
        the caller that finds none under way commits every waiting unit of the
        namespace whose ids no other commit holds (`_commit_together`), the others
        wait for it. A commit refused because another replica stored one of the ids
        first is settled again (a duplicate is acknowledged, other content raises
        `Conflict`); one whose object is no longer planned (committed before, or
        collected as an orphan) raises `PlanGone`. `index(rows, spans)` stores the
        index of the rows an attempt is about to commit (a rebuild's view of them) and
        returns its key; an attempt that does not commit deletes its index again, so
        no index names rows the catalog refused."""
        where = {row_key(row): span for row, span in zip(rows, spans, strict=True)}
        unit = _Stored(namespace, spec, rows, 0, key=key, size=size, where=where, index=index)
        deadline = time.monotonic() + self.config.commit_timeout
        with self._cond:
            self._stored.append(unit)
            while not unit.future.done():
                if namespace not in self._leading:
                    batch = self._take_stored(namespace)
                    if batch:
                        self._lead(namespace, batch)
                        continue
                if unit in self._stored and time.monotonic() > deadline:
                    self._stored.remove(unit)
                    raise StoreError("another commit of these ids is taking too long; retry")
                self._cond.wait(0.1)
        return unit.future.result()

    def _take_stored(self, namespace: str) -> list[_Stored]:
        """Waiting units of `namespace` whose ids neither a commit under way nor an
        earlier unit of the batch holds (caller holds the lock)."""
        batch: list[_Stored] = []
        held = set(self._inflight)
        for unit in list(self._stored):
            if unit.namespace != namespace:
                continue
            ids = {(namespace, row.trajectory_id) for row in unit.rows}
            if not ids & held:
                batch.append(unit)
                self._stored.remove(unit)
            held |= ids
        return batch

    def _lead(self, namespace: str, batch: list[_Stored]) -> None:
        """Commit `batch` with the lock released, its ids held meanwhile (caller holds
        the lock)."""
        ids = {(namespace, row.trajectory_id) for unit in batch for row in unit.rows}
        self._leading.add(namespace)
        self._inflight |= ids
        self._cond.release()
        try:
            self._commit_together(batch)
        finally:
            self._cond.acquire()
            self._leading.discard(namespace)
            self._inflight -= ids
            self._cond.notify_all()

    def _commit_together(self, batch: list[_Stored]) -> None:
        """Settle `batch` against the catalog in one lookup and commit what is fresh in
        one transaction; when the catalog refuses it, each unit again alone (which
        names the one refused, and why). Every unit's future is resolved."""
        try:
            for _attempt in range(_RACES):
                if self._attempt(batch):
                    return
            raise Conflict(f"commits to {batch[0].namespace!r} kept racing other writers; retry")
        except BaseException as exc:
            if not isinstance(exc, R3StoreError):
                log.exception("direct commit of %d blobs failed", len(batch))
            error = exc if isinstance(exc, R3StoreError) else R3StoreError(f"commit failed: {exc}")
            for unit in batch:
                if not unit.future.done():
                    unit.future.set_exception(error)

    def _attempt(self, batch: list[_Stored]) -> bool:
        """One try of `_commit_together`: True once every unit is resolved, False when
        the one unit lost a race to another replica (settle again)."""
        accepted = self._settle(list(batch))
        fresh = [(unit, rows, results) for unit, rows, results in accepted if rows]
        for unit, rows, results in accepted:
            if not rows:
                unit.future.set_result(results)
        if not fresh:
            return True
        try:
            self._commit_blobs(fresh)
        except Conflict as exc:
            if len(batch) == 1:
                self._raced(batch[0], exc)
                return False
            for unit, _rows, _results in fresh:
                self._commit_together([unit])
            return True
        for unit, _rows, results in fresh:
            unit.future.set_result(results)
        return True

    def _raced(self, unit: _Stored, refused: Conflict) -> None:
        """Why the catalog refused `unit` alone: `PlanGone` when its blob is no longer
        planned or a dictionary it names was collected; else (another replica stored
        some of its ids first) it is to be settled again."""
        if isinstance(refused, PlanGone) or not self._catalog.ledger.is_planned(unit.key, DIRECT):
            raise PlanGone(
                f"{unit.key} is no longer planned: committed before with other segments, "
                "collected as an orphan, or its namespace deleted; ask for a new plan"
            ) from None

    def _commit_blobs(self, fresh: list[tuple[_Stored, list[ShardRow], list[PutResult]]]) -> None:
        """Write each blob's index, then commit all their rows in one transaction. The
        indexes are deleted again when nothing can have been committed: an index not
        written, or the catalog refusing the transaction (`Conflict`)."""
        now = self._clock()
        stored, written = [], []
        committing = False
        try:
            for unit, rows, _results in fresh:
                at = [unit.where[row_key(r)] for r in rows]
                shard, entries = blob_records(unit.namespace, unit.key, unit.size, now, rows, at)
                stored.append((shard, entries, load_records(unit.namespace, unit.key, rows)))
                written.append(unit.index(rows, at))
            committing = True
            self._catalog.shards.commit_many(stored)
        except BaseException as exc:
            if not committing or isinstance(exc, Conflict):  # certainly not committed
                for key in written:
                    with contextlib.suppress(R3StoreError):
                        self._store.delete(key)
            raise
        with self._cond:
            self.stats.shards_written += len(fresh)
            self.stats.rows_written += sum(len(rows) for _u, rows, _r in fresh)
            self.stats.bytes_written += sum(u.size for u, _rows, _r in fresh)

    def _settle(self, units: list[_U]) -> list[tuple[_U, list[ShardRow], list[PutResult]]]:
        """Settle each unit against the catalog (and the units before it): a unit with a
        conflict or a bad append fails alone; the others keep their fresh rows."""
        namespace = units[0].namespace
        ids = [row.trajectory_id for unit in units for row in unit.rows]
        known = known_segments(self._catalog.segments.lookup(namespace, ids))
        accepted = []
        for unit in units:
            try:
                fresh, settled = settle_rows(unit.rows, known)
            except R3StoreError as exc:
                unit.future.set_exception(exc)
                continue
            for row in fresh:
                known.setdefault((row.trajectory_id, row.source), []).append(as_segment(row))
            accepted.append((unit, fresh, [settled[row_key(r)] for r in unit.rows]))
        return accepted
