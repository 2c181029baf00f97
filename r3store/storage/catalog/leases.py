"""Consumption by trainers (`catalog.leases`): leases and their trajectories, the
namespace's epoch and consumption count, what retention must keep and which closed
leases it may forget. Step checkpoints and resume are `checkpoints`; each change locks
the namespace's row first (`consumption`), so that replicas sharing the database take,
commit and give back consumption one at a time per namespace.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.catalog_types import TrajectoryEntry
from r3store.errors import InvalidInput, NotFound
from r3store.leases import Lease, LeaseState
from r3store.logic.leasing import not_holder, over_limits, refusal
from r3store.policy import ENGINE, Leasing
from r3store.storage.catalog.consumption import (
    Now,
    committed_after,
    count_samplings,
    lock_consumption,
    lock_in_epoch,
    oldest_kept,
    trim,
)
from r3store.storage.catalog.database import BATCH, Repository, lock
from r3store.storage.catalog.segments import delete_in, lookup_in
from r3store.storage.catalog.tables import lease_items, leases, namespaces, trajectories

# (trajectory id, group id, first stored at) of a trajectory a lease may take
Candidate = tuple[str, str | None, float]
Pick = Callable[[list[Candidate]], list[str]]
# sees the segments (every source) of what a lease takes, and may refuse it by raising
Admit = Callable[[dict[str, list[TrajectoryEntry]]], None]

# why a lease of an earlier epoch is refused (`Fenced`)
_RESUMED = "it resumed from a checkpoint since, and leases of the earlier run are refused"


@dataclass(frozen=True)
class Terms:
    """What `Leases.take` may take and on what terms: trajectories whose every segment
    is at or above `min_version` and that were sampled fewer than `max_times` times
    (None: no bound), held `seconds`. `epoch`: the taker's, refused (`Fenced`) unless
    it is the namespace's (None: any). `holder`: the key taking it, whose open leases
    `leasing` bounds. `commit`: counted at once (a plain sample). `only`: of these
    trajectories alone. `admit` sees every segment of what is chosen and may refuse."""

    min_version: int | None
    max_times: int | None
    seconds: float
    epoch: int | None = None
    holder: str | None = None
    commit: bool = False
    only: Sequence[str] | None = None
    admit: Admit | None = None
    leasing: Leasing | None = None


def _leased(namespace: str, *where: sa.ColumnElement[bool]) -> sa.Select[Any]:
    """The trajectories of the namespace's leases that match `where`."""
    return (
        sa.select(lease_items.c.trajectory_id)
        .join(
            leases,
            sa.and_(
                leases.c.namespace == lease_items.c.namespace,
                leases.c.lease_id == lease_items.c.lease_id,
            ),
        )
        .where(lease_items.c.namespace == namespace, *where)
    )


def _held(namespace: str, now: float) -> sa.Select[Any]:
    """The trajectories of the namespace's open, unexpired leases."""
    return _leased(namespace, leases.c.state == LeaseState.OPEN.value, leases.c.expires_at > now)


def _candidates(conn: Connection, namespace: str, terms: Terms, now: float) -> list[Candidate]:
    """Trajectories (of `terms.only`, if given) whose every segment is at or above
    `terms.min_version`, sampled fewer than `terms.max_times` times, and held by no open
    lease."""
    t = trajectories
    oldest = sa.select(t.c.trajectory_id, sa.func.min(t.c.policy_version).label("oldest")).where(
        t.c.namespace == namespace, t.c.source == ENGINE
    )
    if terms.only is not None:
        oldest = oldest.where(t.c.trajectory_id.in_(list(terms.only)))
    versions = oldest.group_by(t.c.trajectory_id).subquery()
    held = _held(namespace, now).where(lease_items.c.trajectory_id == t.c.trajectory_id)
    query = (
        sa.select(t.c.trajectory_id, t.c.group_id, t.c.created_at)
        .join(versions, versions.c.trajectory_id == t.c.trajectory_id)  # of `only`, if given
        .where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        .where(~held.exists())
    )
    if terms.min_version is not None:
        query = query.where(versions.c.oldest >= terms.min_version)
    if terms.max_times is not None:
        query = query.where(t.c.times_sampled < terms.max_times)
    return [(r.trajectory_id, r.group_id, r.created_at) for r in conn.execute(query)]


def _within_limits(
    conn: Connection, namespace: str, holder: str, leasing: Leasing, size: int, now: float
) -> None:
    """Refuse (`Conflict`) a lease of `size` more trajectories past what `leasing` lets
    `holder`'s open leases hold."""
    count, held = conn.execute(
        sa.select(sa.func.count(), sa.func.coalesce(sa.func.sum(leases.c.size), 0))
        .select_from(leases)
        .where(
            leases.c.namespace == namespace,
            leases.c.holder == holder,
            leases.c.state == LeaseState.OPEN.value,
            leases.c.expires_at > now,
        )
    ).one()
    too_much = over_limits(leasing, int(count), int(held), size)
    if too_much is not None:
        raise too_much


def _insert(conn: Connection, lease: Lease) -> None:
    """Record a new lease and its trajectories, in order."""
    conn.execute(
        leases.insert().values(
            namespace=lease.namespace,
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            state=lease.state.value,
            size=len(lease.trajectory_ids),
            holder=lease.holder,
            created_at=lease.created_at,
            expires_at=lease.expires_at,
            closed_at=lease.closed_at,
            seq=lease.seq,
        )
    )
    if lease.trajectory_ids:
        conn.execute(
            lease_items.insert(),
            [
                {
                    "namespace": lease.namespace,
                    "lease_id": lease.lease_id,
                    "position": i,
                    "trajectory_id": tid,
                }
                for i, tid in enumerate(lease.trajectory_ids)
            ],
        )


def _consume(conn: Connection, namespace: str, seq: int, ids: Sequence[str]) -> None:
    """Make `seq` the namespace's last committed consumption, counting one sampling of
    each of `ids`."""
    conn.execute(namespaces.update().where(namespaces.c.name == namespace).values(consumed=seq))
    count_samplings(conn, namespace, dict.fromkeys(ids, 1), +1)


def _items(conn: Connection, namespace: str, lease_id: str) -> tuple[str, ...]:
    query = (
        sa.select(lease_items.c.trajectory_id)
        .where(lease_items.c.namespace == namespace, lease_items.c.lease_id == lease_id)
        .order_by(lease_items.c.position)
    )
    return tuple(conn.execute(query).scalars())


def _lease_of(row: Any, ids: tuple[str, ...]) -> Lease:
    return Lease(
        row.namespace,
        row.lease_id,
        row.epoch,
        LeaseState(row.state),
        ids,
        row.created_at,
        row.expires_at,
        row.closed_at,
        row.seq,
        row.holder,
    )


def _get(conn: Connection, namespace: str, lease_id: str) -> Lease:
    row = conn.execute(
        sa.select(leases).where(leases.c.namespace == namespace, leases.c.lease_id == lease_id)
    ).first()
    if row is None:
        raise NotFound(f"no lease {lease_id} in namespace {namespace!r}")
    return _lease_of(row, _items(conn, namespace, lease_id))


def _protected(conn: Connection, namespace: str, now: float) -> set[str]:
    """`Leases.protected` on the caller's connection."""
    found = set(conn.execute(_held(namespace, now)).scalars())
    consumed = oldest_kept(conn, namespace)
    if consumed is not None:
        found.update(conn.execute(_leased(namespace, committed_after(consumed))).scalars())
    return found


class Leases(Repository):
    # leases

    def take(self, namespace: str, pick: Pick, terms: Terms, now: Now) -> Lease:
        """Lease what `pick` chooses among the trajectories free to take on `terms`
        (within the staleness window, under `max_times`, held by no open lease; of
        `only`, when given), for `terms.seconds`; `commit`: counted at once, as one
        committed consumption. A lease past what `leasing` lets `holder` hold is a
        `Conflict`; `admit` sees every segment of what `pick` chose (read in the same
        transaction). Either may raise to refuse; nothing is changed then."""
        with self._db.begin() as conn:
            ns, now = lock_in_epoch(conn, namespace, now, terms.epoch, _RESUMED)
            chosen = pick(_candidates(conn, namespace, terms, now))
            if len(set(chosen)) != len(chosen):
                raise InvalidInput("a lease names a trajectory twice")
            if terms.leasing is not None and terms.holder is not None and not terms.commit:
                _within_limits(conn, namespace, terms.holder, terms.leasing, len(chosen), now)
            if terms.admit is not None:
                terms.admit(lookup_in(conn, namespace, chosen))
            if terms.commit and not chosen:
                return Lease(namespace, "0" * 32, ns.epoch, LeaseState.COMMITTED, (), now, now)
            seq = ns.consumed + 1 if terms.commit else None
            lease = Lease(
                namespace,
                secrets.token_hex(16),
                ns.epoch,
                LeaseState.COMMITTED if terms.commit else LeaseState.OPEN,
                tuple(chosen),
                now,
                now if terms.commit else now + terms.seconds,
                now if terms.commit else None,
                seq,
                terms.holder,
            )
            _insert(conn, lease)
            if seq is not None:
                _consume(conn, namespace, seq, lease.trajectory_ids)
        return lease

    def commit(
        self,
        namespace: str,
        lease_id: str,
        now: Now,
        token: str | None = None,
        by: str | None = None,
    ) -> Lease:
        """Count one sampling of each of the lease's trajectories, once: a lease
        committed before answers `LeaseCommitted` (unless committed with the same
        `token`: a retry of that commit, answered as it was); one released, expired or
        of an earlier epoch is refused too, and one another key than `by` took
        (`Forbidden`; `by` None: any). Nothing is counted when refused."""
        with self._db.begin() as conn:
            ns, at = lock_consumption(conn, namespace, now)
            lease = _get(conn, namespace, lease_id)
            foreign = not_holder(lease, by, "commit")
            if foreign is not None:
                raise foreign
            if lease.state is LeaseState.COMMITTED and token is not None:
                stored = conn.execute(
                    sa.select(leases.c.commit_token).where(
                        leases.c.namespace == namespace, leases.c.lease_id == lease_id
                    )
                ).scalar()
                if stored == token:
                    return lease
            why = refusal(lease, ns.epoch, at, "commit")
            if why is None:
                seq = ns.consumed + 1
                _consume(conn, namespace, seq, lease.trajectory_ids)
                conn.execute(
                    leases.update()
                    .where(leases.c.namespace == namespace, leases.c.lease_id == lease_id)
                    .values(
                        state=LeaseState.COMMITTED.value, closed_at=at, seq=seq, commit_token=token
                    )
                )
                lease = dataclasses.replace(
                    lease, state=LeaseState.COMMITTED, closed_at=at, seq=seq
                )
        if why is not None:  # raised once the expiry it may have marked is committed
            raise why
        return lease

    def release(self, namespace: str, lease_id: str, now: Now, by: str | None = None) -> Lease:
        """Give the lease's trajectories back uncounted (`by`: as `commit`)."""
        return self._close(namespace, lease_id, now, "release", by=by)

    def renew(
        self, namespace: str, lease_id: str, seconds: float, now: Now, by: str | None = None
    ) -> Lease:
        """Hold the lease `seconds` from now (an open, unexpired lease only)."""
        return self._close(namespace, lease_id, now, "renew", seconds, by)

    def _close(
        self,
        namespace: str,
        lease_id: str,
        now: Now,
        action: str,
        seconds: float = 0.0,
        by: str | None = None,
    ) -> Lease:
        with self._db.begin() as conn:
            ns, at = lock_consumption(conn, namespace, now)
            lease = _get(conn, namespace, lease_id)
            foreign = not_holder(lease, by, action)
            if foreign is not None:
                raise foreign
            why = refusal(lease, ns.epoch, at, action)
            if why is None:
                if action == "renew":
                    values: dict[str, Any] = {"expires_at": at + seconds}
                else:
                    values = {"state": LeaseState.RELEASED.value, "closed_at": at}
                conn.execute(
                    leases.update()
                    .where(leases.c.namespace == namespace, leases.c.lease_id == lease_id)
                    .values(**values)
                )
                lease = _get(conn, namespace, lease_id)
        if why is not None:
            raise why
        return lease

    def get(self, namespace: str, lease_id: str) -> Lease:
        with self._db.connect() as conn:
            return _get(conn, namespace, lease_id)

    def open(
        self, namespace: str, now: float, limit: int = 1000, holder: str | None = None
    ) -> list[Lease]:
        """The namespace's open, unexpired leases (`holder`'s only, when given), oldest
        first: the first `limit`."""
        query = (
            sa.select(leases)
            .where(
                leases.c.namespace == namespace,
                leases.c.state == LeaseState.OPEN.value,
                leases.c.expires_at > now,
            )
            .order_by(leases.c.created_at, leases.c.lease_id)
            .limit(limit)
        )
        if holder is not None:
            query = query.where(leases.c.holder == holder)
        with self._db.connect() as conn:
            rows = conn.execute(query).all()
            return [_lease_of(r, _items(conn, namespace, r.lease_id)) for r in rows]

    def epoch(self, namespace: str) -> tuple[int, int]:
        """The namespace's epoch and the number of its last committed consumption."""
        with self._db.connect() as conn:
            row = conn.execute(
                sa.select(namespaces.c.epoch, namespaces.c.consumed).where(
                    namespaces.c.name == namespace
                )
            ).first()
        if row is None:
            raise NotFound(f"no namespace {namespace!r}")
        return int(row.epoch), int(row.consumed)

    # what retention must keep, and what the catalog may forget

    def protected(self, namespace: str, now: float) -> set[str]:
        """Trajectories that retention and eviction must keep: held by an open lease, or
        consumed after the oldest kept checkpoint (resuming to it hands them out again)
        in a lease still committed, or undone by a resume (the resumed run takes them
        again)."""
        with self._db.connect() as conn:
            return _protected(conn, namespace, now)

    def drop(
        self, namespace: str, ids: Sequence[str], shard_keys: Sequence[str] | None, now: Now
    ) -> tuple[int, int]:
        """Retention's deletion (`Segments.delete`) of those of `ids` that are not
        protected, judged in the same transaction under the namespace's lock (a lease
        taken since retention chose its victims keeps its trajectories); returns the
        segments removed and the ids kept."""
        with self._db.begin() as conn:
            if not lock(conn, namespace):  # deleted meanwhile, its trajectories with it
                return 0, 0
            kept = _protected(conn, namespace, now() if callable(now) else now)
            gone = [tid for tid in ids if tid not in kept]
            return delete_in(conn, namespace, gone, shard_keys), len(ids) - len(gone)

    def prune(self, namespace: str, before: float) -> int:
        """Keep only the newest `retention.keep_checkpoints` checkpoints (a lowered
        setting takes effect here too), then forget leases closed (or expired) before
        `before`, except those committed after the oldest kept checkpoint (still, or
        undone since: a resume undoes or hands them out again); returns leases
        forgotten. One transaction under the namespace's lock."""
        forgotten = 0
        with self._db.begin() as conn:
            if not lock(conn, namespace):  # deleted meanwhile, its leases with it
                return 0
            trim(conn, namespace)
            ended = sa.func.coalesce(leases.c.closed_at, leases.c.expires_at) < before
            query = sa.select(leases.c.lease_id).where(leases.c.namespace == namespace, ended)
            consumed = oldest_kept(conn, namespace)
            if consumed is not None:  # after the oldest checkpoint: what a resume undoes or redoes
                query = query.where(~committed_after(consumed))
            ids = list(conn.execute(query).scalars())
            for begin in range(0, len(ids), BATCH):
                part = ids[begin : begin + BATCH]
                conn.execute(
                    lease_items.delete().where(
                        lease_items.c.namespace == namespace, lease_items.c.lease_id.in_(part)
                    )
                )
                forgotten += conn.execute(
                    leases.delete().where(
                        leases.c.namespace == namespace, leases.c.lease_id.in_(part)
                    )
                ).rowcount
        return forgotten


def delete_namespace(conn: Connection, namespace: str) -> None:
    """Forget the namespace's leases (within the caller's transaction)."""
    for table in (lease_items, leases):
        conn.execute(table.delete().where(table.c.namespace == namespace))
