"""The catalog's statistics: expert load by commit and agreement by trajectory.
`Stats` is the repository (`catalog.stats`); the functions here take a connection, so
that a shard's commit records its load in the same transaction. The tables
(`r3store.storage.catalog.tables`):

- `expert_load`: one row per (shard committed, policy version, source): the `[L, E]`
  expert counts and token count of the segments that commit stored. Rows are history:
  retention and compaction leave them (a namespace's deletion removes them); a rebuild
  makes them again from the shards it finds.
- `route_agreement`: one row per trajectory segment and pair of sources (`source_a` <
  `source_b`): the per-layer overlap (`r3store.logic.stats.Overlap`) of their routes.

Counts are kept as `r3store.logic.stats.pack` blobs.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.logic import stats
from r3store.policy import ENGINE, Source
from r3store.storage.catalog.database import Repository
from r3store.storage.catalog.tables import expert_load, route_agreement, trajectories


@dataclass(frozen=True)
class LoadRecord:
    """The expert load of what one commit stored for one policy version and source."""

    namespace: str
    shard_key: str
    policy_version: int
    source: Source
    tokens: int
    counts: stats.Counts  # [L, E]


@dataclass(frozen=True)
class AgreementRecord:
    """How far two sources' routes of one segment agree, per layer."""

    namespace: str
    trajectory_id: str
    start: int
    source_a: Source  # source_a < source_b
    source_b: Source
    policy_version: int
    tokens: int
    overlap: stats.Overlap


def insert_loads(conn: Connection, records: Sequence[LoadRecord]) -> None:
    if records:
        conn.execute(
            expert_load.insert(),
            [
                {
                    "namespace": r.namespace,
                    "shard_key": r.shard_key,
                    "policy_version": r.policy_version,
                    "source": r.source,
                    "tokens": r.tokens,
                    "counts": stats.pack(r.counts),
                }
                for r in records
            ],
        )


def _newest(
    conn: Connection, table: sa.Table, where: sa.ColumnElement[bool], newest: int | None
) -> sa.ColumnElement[bool]:
    """`where`, narrowed to the `newest` policy versions it holds (None: all of them),
    so that a namespace's history costs nothing when only its end is asked for."""
    if newest is None:
        return where
    versions = list(
        conn.execute(
            sa.select(table.c.policy_version)
            .where(where)
            .distinct()
            .order_by(table.c.policy_version.desc())
            .limit(newest)
        ).scalars()
    )
    return where & table.c.policy_version.in_(versions)


def loads(
    conn: Connection,
    namespace: str,
    source: Source,
    shape: tuple[int, int],
    newest: int | None = None,
) -> dict[int, tuple[int, stats.Counts]]:
    """Tokens and `[L, E]` load per policy version, summed over commits; of the
    `newest` versions only, when given."""
    t = expert_load
    where = _newest(conn, t, (t.c.namespace == namespace) & (t.c.source == source), newest)
    query = (
        sa.select(t.c.policy_version, t.c.tokens, t.c.counts)
        .where(where)
        .order_by(t.c.policy_version)
    )
    out: dict[int, tuple[int, stats.Counts]] = {}
    for version, tokens, blob in conn.execute(query):
        counts = stats.unpack(blob, shape)
        if version in out:
            held_tokens, held = out[version]
            out[version] = (held_tokens + tokens, held + counts)
        else:
            out[version] = (int(tokens), counts)
    return out


def upsert_agreements(conn: Connection, records: Sequence[AgreementRecord]) -> None:
    """Record agreements; one already recorded for the same segment and pair is kept
    (the routes of a stored segment never change)."""
    t = route_agreement
    for r in records:
        key = (
            (t.c.namespace == r.namespace)
            & (t.c.trajectory_id == r.trajectory_id)
            & (t.c.start == r.start)
            & (t.c.source_a == r.source_a)
            & (t.c.source_b == r.source_b)
        )
        if conn.execute(sa.select(sa.func.count()).select_from(t).where(key)).scalar_one():
            continue
        conn.execute(
            t.insert().values(
                namespace=r.namespace,
                trajectory_id=r.trajectory_id,
                start=r.start,
                source_a=r.source_a,
                source_b=r.source_b,
                policy_version=r.policy_version,
                tokens=r.tokens,
                matches=stats.pack(r.overlap.matches),
                slots=stats.pack(r.overlap.slots),
            )
        )


def agreements(
    conn: Connection,
    namespace: str,
    pair: tuple[Source, Source],
    num_layers: int,
    newest: int | None = None,
) -> dict[int, tuple[int, int, stats.Overlap]]:
    """Per policy version: segments, tokens and summed overlap of the pair of sources;
    of the `newest` versions only, when given."""
    t = route_agreement
    a, b = sorted(pair)
    where = (t.c.namespace == namespace) & (t.c.source_a == a) & (t.c.source_b == b)
    query = (
        sa.select(t.c.policy_version, t.c.tokens, t.c.matches, t.c.slots)
        .where(_newest(conn, t, where, newest))
        .order_by(t.c.policy_version)
    )
    out: dict[int, tuple[int, int, stats.Overlap]] = {}
    for version, tokens, matches, slots in conn.execute(query):
        overlap = stats.Overlap(
            stats.unpack(matches, (num_layers,)), stats.unpack(slots, (num_layers,))
        )
        segments, held_tokens, held = out.get(version, (0, 0, None))
        out[version] = (
            segments + 1,
            held_tokens + tokens,
            overlap if held is None else held + overlap,
        )
    return out


def delete_namespace(conn: Connection, namespace: str) -> None:
    conn.execute(expert_load.delete().where(expert_load.c.namespace == namespace))
    conn.execute(route_agreement.delete().where(route_agreement.c.namespace == namespace))


def delete_all(conn: Connection) -> None:
    conn.execute(expert_load.delete())
    conn.execute(route_agreement.delete())


class Stats(Repository):
    """Expert load and agreement between sources (`catalog.stats`)."""

    def expert_loads(
        self, namespace: str, source: Source, shape: tuple[int, int], newest: int | None = None
    ) -> dict[int, tuple[int, stats.Counts]]:
        with self._db.connect() as conn:
            return loads(conn, namespace, source, shape, newest)

    def add_agreements(self, records: Sequence[AgreementRecord]) -> None:
        with self._db.begin() as conn:
            upsert_agreements(conn, records)

    def agreements(
        self,
        namespace: str,
        pair: tuple[Source, Source],
        num_layers: int,
        newest: int | None = None,
    ) -> dict[int, tuple[int, int, stats.Overlap]]:
        with self._db.connect() as conn:
            return agreements(conn, namespace, pair, num_layers, newest)

    def annotated_ids(self, namespace: str) -> list[str]:
        """Trajectories holding routes of a source other than engine."""
        t = trajectories
        query = (
            sa.select(t.c.trajectory_id)
            .where(t.c.namespace == namespace, t.c.source != ENGINE)
            .distinct()
            .order_by(t.c.trajectory_id)
        )
        with self._db.connect() as conn:
            return list(conn.execute(query).scalars())
