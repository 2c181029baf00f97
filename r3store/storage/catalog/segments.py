"""Trajectory segments (`catalog.segments`): where each lies, looked up by id, group or
policy version; counts; the candidates of sampling and their counts; retention.

A trajectory is one or more segments (multi-turn appends), each a row keyed by its route
source and start token; the `engine` rows are the trajectory (segment 0 starts at 0 and
carries its sampling count), rows of other sources annotate them. Segments are stored
with their shard (`r3store.storage.catalog.shards`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.catalog_types import TrajectoryEntry
from r3store.policy import ENGINE
from r3store.storage.catalog.database import BATCH, Repository, segment_of
from r3store.storage.catalog.tables import trajectories


class Segments(Repository):
    def _select(self, namespace: str) -> sa.Select[Any]:
        """The trajectories' own rows (engine routes)."""
        t = trajectories
        return sa.select(t).where(t.c.namespace == namespace, t.c.source == ENGINE)

    def lookup(self, namespace: str, ids: Iterable[str]) -> dict[str, list[TrajectoryEntry]]:
        """Segments of the ids that exist, every source, in start order (missing ids
        are absent)."""
        with self._db.connect() as conn:
            return lookup_in(conn, namespace, ids)

    def by_group(self, namespace: str, group_id: str) -> list[TrajectoryEntry]:
        query = self._select(namespace).where(trajectories.c.group_id == group_id)
        return self._entries(query.order_by(trajectories.c.trajectory_id, trajectories.c.start))

    def by_versions(self, namespace: str, low: int, high: int) -> list[TrajectoryEntry]:
        """Segments with `low <= policy_version <= high`, oldest first."""
        query = self._select(namespace).where(trajectories.c.policy_version.between(low, high))
        return self._entries(
            query.order_by(trajectories.c.created_at, trajectories.c.trajectory_id)
        )

    def _entries(self, query: sa.Select[Any]) -> list[TrajectoryEntry]:
        with self._db.connect() as conn:
            return [segment_of(row) for row in conn.execute(query)]

    def count_by_version(self, namespace: str) -> dict[int, int]:
        """Trajectories by the policy version of their first segment."""
        t = trajectories
        query = (
            sa.select(t.c.policy_version, sa.func.count())
            .where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
            .group_by(t.c.policy_version)
            .order_by(t.c.policy_version)
        )
        with self._db.connect() as conn:
            return {int(v): int(n) for v, n in conn.execute(query)}

    def newest_version(self, namespace: str, nth: int = 1) -> int | None:
        """The `nth` newest (1: the newest) policy version that a segment of the
        namespace holds routes of; None when fewer versions do."""
        t = trajectories
        query = (
            sa.select(t.c.policy_version)
            .where(t.c.namespace == namespace)
            .distinct()
            .order_by(t.c.policy_version.desc())
            .limit(1)
            .offset(nth - 1)
        )
        with self._db.connect() as conn:
            found = conn.execute(query).scalar()
        return None if found is None else int(found)

    def count(self, namespace: str) -> int:
        """Trajectories (not segments) in the namespace."""
        query = sa.select(sa.func.count()).select_from(trajectories)
        t = trajectories
        query = query.where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        with self._db.connect() as conn:
            return int(conn.execute(query).scalar_one())

    def sampling_totals(self, namespace: str) -> tuple[int, int]:
        """Samplings of the namespace's trajectories, and trajectories sampled at all."""
        t = trajectories
        query = sa.select(
            sa.func.coalesce(sa.func.sum(t.c.times_sampled), 0),
            sa.func.count().filter(t.c.times_sampled > 0),
        ).where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        with self._db.connect() as conn:
            total, sampled = conn.execute(query).one()
        return int(total), int(sampled)

    def retention_victims(
        self,
        namespace: str,
        min_version: int | None,
        created_before: float | None,
        sampled_at_least: int | None,
    ) -> list[str]:
        """Trajectories to drop: a segment older than `min_version`, first stored before
        `created_before`, or sampled `sampled_at_least` times."""
        t = trajectories
        victims: set[str] = set()
        with self._db.connect() as conn:
            if min_version is not None:
                query = sa.select(t.c.trajectory_id).where(
                    t.c.namespace == namespace, t.c.policy_version < min_version
                )
                victims.update(conn.execute(query).scalars())
            first = self._select(namespace).with_only_columns(t.c.trajectory_id)
            first = first.where(t.c.start == 0)
            if created_before is not None:
                victims.update(conn.execute(first.where(t.c.created_at < created_before)).scalars())
            if sampled_at_least is not None:
                query = first.where(t.c.times_sampled >= sampled_at_least)
                victims.update(conn.execute(query).scalars())
        return sorted(victims)

    def delete(
        self, namespace: str, ids: Sequence[str], shard_keys: Sequence[str] | None = None
    ) -> int:
        """Forget trajectories (all their segments); returns segments removed. With
        `shard_keys`, only trajectories all of whose segments are still in those shards:
        one with a segment a pass moved elsewhere since (into a shard a tombstone does
        not name yet) stays whole, for the next pass."""
        with self._db.begin() as conn:
            return delete_in(conn, namespace, ids, shard_keys)

    def entries_in(self, key: str) -> list[TrajectoryEntry]:
        return self._entries(sa.select(trajectories).where(trajectories.c.shard_key == key))

    def dictionary_for(self, namespace: str, version: int) -> tuple[bytes, int] | None:
        """The dictionary of the newest policy version at or below `version` whose rows
        use one, and that version."""
        t = trajectories
        query = (
            sa.select(t.c.dictionary, t.c.policy_version)
            .where(
                t.c.namespace == namespace,
                t.c.dictionary.is_not(None),
                t.c.policy_version <= version,
            )
            .order_by(t.c.policy_version.desc())
            .limit(1)
        )
        with self._db.connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else (row.dictionary, row.policy_version)


def lookup_in(
    conn: Connection, namespace: str, ids: Iterable[str]
) -> dict[str, list[TrajectoryEntry]]:
    """`Segments.lookup` on the caller's connection."""
    wanted = list(dict.fromkeys(ids))
    found: dict[str, list[TrajectoryEntry]] = defaultdict(list)
    t = trajectories
    for begin in range(0, len(wanted), BATCH):
        part = wanted[begin : begin + BATCH]
        query = sa.select(t).where(t.c.namespace == namespace, t.c.trajectory_id.in_(part))
        for row in conn.execute(query.order_by(t.c.start, t.c.source)):
            found[row.trajectory_id].append(segment_of(row))
    return dict(found)


def delete_in(
    conn: Connection, namespace: str, ids: Sequence[str], shard_keys: Sequence[str] | None
) -> int:
    """`Segments.delete` within the caller's transaction."""
    t = trajectories
    removed = 0
    for begin in range(0, len(ids), BATCH):
        part = list(ids[begin : begin + BATCH])
        query = t.delete().where(t.c.namespace == namespace, t.c.trajectory_id.in_(part))
        if shard_keys is not None:
            other = t.alias("other")
            elsewhere = sa.exists().where(
                other.c.namespace == t.c.namespace,
                other.c.trajectory_id == t.c.trajectory_id,
                other.c.shard_key.not_in(list(shard_keys)),
            )
            query = query.where(~elsewhere)
        removed += conn.execute(query).rowcount
    return removed
