"""Shards (`catalog.shards`): a stored shard recorded with its segments and their
expert load in one transaction (`commit`), rewritten into another (`replace`), retired
once no row points at it, forgotten once its object is gone; what each live shard still
holds (`usage`); and the whole catalog filled again by a rebuild (`replace_all`).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Iterator, Sequence

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.catalog_types import NamespaceInfo, ShardInfo, ShardUsage, TrajectoryEntry
from r3store.errors import Conflict, NotFound, PlanGone
from r3store.storage.catalog import ledger, stats
from r3store.storage.catalog.database import Repository, lock, namespace_row, segment_row
from r3store.storage.catalog.stats import LoadRecord
from r3store.storage.catalog.tables import namespaces, shards, trajectories


def insert(conn: Connection, shard: ShardInfo, entries: Sequence[TrajectoryEntry]) -> None:
    """A shard's row and its segments' rows, in the caller's transaction."""
    conn.execute(shards.insert().values(**shard.__dict__))
    if entries:
        conn.execute(trajectories.insert(), [segment_row(e) for e in entries])


class Shards(Repository):
    def get(self, key: str) -> ShardInfo:
        with self._db.connect() as conn:
            row = conn.execute(sa.select(shards).where(shards.c.key == key)).first()
        if row is None:
            raise NotFound(f"no shard {key!r} in the catalog")
        return ShardInfo(**row._mapping)

    def commit(
        self,
        shard: ShardInfo,
        entries: Sequence[TrajectoryEntry],
        loads: Sequence[LoadRecord] = (),
    ) -> None:
        """Record a stored shard, its rows and their expert load in one transaction:
        all visible, or none (`commit_many` of one)."""
        self.commit_many([(shard, entries, loads)])

    def commit_many(
        self,
        stored: Sequence[tuple[ShardInfo, Sequence[TrajectoryEntry], Sequence[LoadRecord]]],
    ) -> None:
        """Record stored shards of one namespace, their rows and their expert load in
        one transaction: all visible, or none. Each shard's upload must be planned
        (`Conflict` otherwise); the dictionaries rows name (a direct write's) are held
        in it: one collected meanwhile refuses the commit (`PlanGone`: encode again)."""
        if not stored:
            return
        namespace = stored[0][0].namespace
        keys = [shard.key for shard, _entries, _loads in stored]
        named = {
            e.spans.dictionary
            for _shard, entries, _loads in stored
            for e in entries
            if e.spans.dictionary is not None
        }
        at = max(shard.created_at for shard, _entries, _loads in stored)  # their clock
        with self._db.begin() as conn:
            if ledger.unplan(conn, keys) != len(keys):
                raise Conflict(
                    f"{', '.join(keys)}: not all planned, or collected as orphans meanwhile"
                )
            if named and not ledger.hold(conn, namespace, named, at):
                raise PlanGone(
                    "a dictionary the rows were compressed with is no longer the namespace's "
                    "(collected meanwhile): encode them again with a new plan's dictionary"
                )
            conn.execute(shards.insert(), [shard.__dict__ for shard, _e, _l in stored])
            rows = [segment_row(e) for _shard, entries, _loads in stored for e in entries]
            if rows:
                conn.execute(trajectories.insert(), rows)
            stats.insert_loads(conn, [load for _s, _e, loads in stored for load in loads])

    def replace(
        self, old: Sequence[str], new: ShardInfo, entries: Sequence[TrajectoryEntry], now: float
    ) -> int:
        """Point the rows of shards `old` at `new` in one transaction, and retire `old`.

        The rows are taken with one `DELETE ... RETURNING`, which sees the latest state:
        when any of `entries` was dropped by retention or moved by a pass running
        elsewhere since they were read, nothing changes and `Conflict` is raised (the new
        object would hold rows the catalog no longer has, which a rebuild could bring
        back). What a row's life changes meanwhile (`times_sampled`, counted by leases,
        samples and resumes that ran while the pass built the object) is taken from the
        rows removed, never from `entries`; the namespace's row is locked first, as
        consumption locks it, so that no count lands on the rows being removed. The
        dictionaries the rows name are held in the same transaction, and a collected one
        refuses the switch too. Returns rows moved.
        """
        t = trajectories
        try:
            with self._db.begin() as conn:
                if not lock(conn, new.namespace):
                    raise Conflict(f"the namespace {new.namespace!r} was deleted")
                taken = conn.execute(
                    t.delete()
                    .where(t.c.shard_key.in_(old))
                    .returning(
                        t.c.trajectory_id,
                        t.c.source,
                        t.c.start,
                        t.c.dictionary,
                        t.c.times_sampled,
                        t.c.created_at,
                    )
                ).all()
                still = {(r.trajectory_id, r.source, r.start): r for r in taken}
                wanted = {(e.trajectory_id, e.source, e.start) for e in entries}
                if set(still) != wanted:
                    raise Conflict(
                        f"{len(wanted - set(still))} of its rows were dropped or moved "
                        f"meanwhile, {len(set(still) - wanted)} added"
                    )
                moved = [
                    dataclasses.replace(
                        e,
                        times_sampled=(
                            row := still[(e.trajectory_id, e.source, e.start)]
                        ).times_sampled,
                        created_at=row.created_at,
                    )
                    for e in entries
                ]
                # a dictionary the old rows named cannot have been collected (recorded
                # if an older server did not); one the pass chose must still be held
                named = {r.dictionary for r in taken if r.dictionary is not None}
                used = {e.spans.dictionary for e in entries if e.spans.dictionary is not None}
                for digest in named & used:
                    ledger.record(conn, new.namespace, digest, 0, now)
                if not ledger.hold(conn, new.namespace, used - named, now):
                    raise Conflict("a dictionary its rows use was collected meanwhile")
                if not ledger.unplan(conn, [new.key]):
                    raise Conflict(f"{new.key} was collected as an orphan meanwhile")
                insert(conn, new, moved)
                conn.execute(shards.update().where(shards.c.key.in_(old)).values(retired_at=now))
        except Conflict as exc:
            raise Conflict(f"rewriting {', '.join(old)} raced another pass: {exc}") from exc
        return len(entries)

    def retire_empty(self, key: str, now: float) -> bool:
        """Retire a shard no row points at (checked in the same transaction)."""
        with self._db.begin() as conn:
            rows = conn.execute(
                sa.select(sa.func.count())
                .select_from(trajectories)
                .where(trajectories.c.shard_key == key)
            ).scalar_one()
            if rows:
                return False
            conn.execute(shards.update().where(shards.c.key == key).values(retired_at=now))
        return True

    def retired_before(self, cutoff: float) -> list[str]:
        query = sa.select(shards.c.key).where(shards.c.retired_at < cutoff)
        with self._db.connect() as conn:
            return list(conn.execute(query).scalars())

    def forget(self, key: str) -> None:
        with self._db.begin() as conn:
            conn.execute(shards.delete().where(shards.c.key == key))

    def all_keys(self) -> set[str]:
        with self._db.connect() as conn:
            return set(conn.execute(sa.select(shards.c.key)).scalars())

    def usage(self, namespace: str | None = None) -> list[ShardUsage]:
        """Live (not retired) shards with the rows and route bytes still pointing at them."""
        t, s = trajectories, shards
        live = (
            sa.select(
                t.c.shard_key,
                sa.func.count().label("rows"),
                sa.func.sum(t.c.route_bytes).label("bytes"),
            )
            .group_by(t.c.shard_key)
            .subquery()
        )
        query = (
            sa.select(s, live.c.rows, live.c.bytes)
            .select_from(s.outerjoin(live, live.c.shard_key == s.c.key))
            .where(s.c.retired_at.is_(None))
        )
        if namespace is not None:
            query = query.where(s.c.namespace == namespace)
        with self._db.connect() as conn:
            return [
                ShardUsage(
                    r.key,
                    r.namespace,
                    r.size,
                    r.route_bytes,
                    r.rows or 0,
                    int(r.bytes or 0),
                    r.created_at,
                    r.rest_level,
                )
                for r in conn.execute(query.order_by(s.c.created_at))
            ]

    def replace_all(
        self,
        spaces: Sequence[NamespaceInfo],
        contents: Iterator[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]],
        dictionaries: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Empty the catalog and fill it again, in one transaction (used by rebuilds);
        `dictionaries` (namespace, digest) found in the store are recorded as this
        catalog's, so that those no row names are collected in time."""
        with self._db.begin() as conn:
            for table in (trajectories, shards, namespaces):
                conn.execute(table.delete())
            stats.delete_all(conn)
            ledger.delete_all(conn)
            for ns in spaces:
                conn.execute(namespaces.insert().values(**namespace_row(ns)))
            for shard, entries, loads in contents:
                insert(conn, shard, entries)
                stats.insert_loads(conn, loads)
            ledger.record_in_use(conn, time.time())
            for namespace, digest in dictionaries:
                ledger.record(conn, namespace, digest, 0, time.time())
