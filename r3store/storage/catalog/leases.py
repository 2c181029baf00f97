"""Consumption by trainers (`catalog.leases`): leases, their trajectories, the
namespace's epoch and consumption count, and step checkpoints.

Every change runs in one transaction that first locks the namespace's row (an UPDATE
that changes nothing: PostgreSQL's row lock, SQLite's write lock), so that replicas
sharing the database take, commit and undo consumption one at a time per namespace:
a trajectory is held by at most one open lease, a lease is committed at most once,
and a commit racing its expiry either counts or returns the trajectories, never both.

A committed lease gets the namespace's next consumption number (`seq`); a checkpoint
records the number it had reached, so resuming to it undoes exactly the leases
numbered after it that are still committed (and sets the count back to it: the undone
leases' numbers are given again). Sampling counts stay in `trajectories.times_sampled`.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.catalog_types import TrajectoryEntry
from r3store.errors import Conflict, Fenced, InvalidInput, NotFound
from r3store.leases import Checkpoint, Lease, LeaseState, Resumed
from r3store.logic.leasing import not_holder, over_limits, refusal
from r3store.policy import ENGINE, Leasing, NamespaceSettings
from r3store.storage.catalog.database import BATCH, Database, lock
from r3store.storage.catalog.segments import delete_in, lookup_in
from r3store.storage.catalog.tables import (
    checkpoints,
    lease_items,
    leases,
    namespaces,
    trajectories,
)

# (trajectory id, group id, first stored at) of a trajectory a lease may take
Candidate = tuple[str, str | None, float]
Pick = Callable[[list[Candidate]], list[str]]
# the time of a change: a clock, read once the namespace is locked (a wait for the lock
# must not stretch a lease past its expiry), or a fixed time (tests)
Now = float | Callable[[], float]
# sees the segments (every source) of what a lease takes, and may refuse it by raising
Admit = Callable[[dict[str, list[TrajectoryEntry]]], None]


def _lock(conn: Connection, namespace: str, now: Now) -> tuple[Any, float]:
    """Lock the namespace's row for the transaction; returns it and the time then, after
    marking the leases due by then expired (so that a replica whose clock is behind
    cannot commit a lease whose trajectories another replica already gave out again)."""
    if not lock(conn, namespace):
        raise NotFound(f"no namespace {namespace!r}")
    at = now() if callable(now) else now
    conn.execute(
        leases.update()
        .where(
            leases.c.namespace == namespace,
            leases.c.state == LeaseState.OPEN.value,
            leases.c.expires_at <= at,
        )
        .values(state=LeaseState.EXPIRED.value, closed_at=leases.c.expires_at)
    )
    row = conn.execute(sa.select(namespaces).where(namespaces.c.name == namespace)).one()
    return row, at


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


def _candidates(
    conn: Connection,
    namespace: str,
    min_version: int | None,
    max_times: int | None,
    now: float,
    only: Sequence[str] | None = None,
) -> list[Candidate]:
    """Trajectories (of `only`, if given) whose every segment is at or above
    `min_version`, sampled fewer than `max_times` times, and held by no open lease."""
    t = trajectories
    oldest = sa.select(t.c.trajectory_id, sa.func.min(t.c.policy_version).label("oldest")).where(
        t.c.namespace == namespace, t.c.source == ENGINE
    )
    if only is not None:
        oldest = oldest.where(t.c.trajectory_id.in_(list(only)))
    versions = oldest.group_by(t.c.trajectory_id).subquery()
    held = _held(namespace, now).where(lease_items.c.trajectory_id == t.c.trajectory_id)
    query = (
        sa.select(t.c.trajectory_id, t.c.group_id, t.c.created_at)
        .join(versions, versions.c.trajectory_id == t.c.trajectory_id)  # of `only`, if given
        .where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        .where(~held.exists())
    )
    if min_version is not None:
        query = query.where(versions.c.oldest >= min_version)
    if max_times is not None:
        query = query.where(t.c.times_sampled < max_times)
    return [(r.trajectory_id, r.group_id, r.created_at) for r in conn.execute(query)]


def _count(conn: Connection, namespace: str, counts: dict[str, int], sign: int) -> None:
    """Add `sign * counts[id]` samplings to each trajectory (never below 0)."""
    t = trajectories
    by_amount: dict[int, list[str]] = defaultdict(list)
    for tid, k in counts.items():
        by_amount[k].append(tid)
    for k, ids in by_amount.items():
        value = (
            t.c.times_sampled + k
            if sign > 0
            else sa.case((t.c.times_sampled >= k, t.c.times_sampled - k), else_=0)
        )
        for begin in range(0, len(ids), BATCH):
            conn.execute(
                t.update()
                .where(
                    t.c.namespace == namespace,
                    t.c.trajectory_id.in_(ids[begin : begin + BATCH]),
                    t.c.start == 0,
                    t.c.source == ENGINE,
                )
                .values(times_sampled=value)
            )


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


def _after(consumed: int) -> sa.ColumnElement[bool]:
    """Leases committed after consumption number `consumed`, still or undone since."""
    return sa.and_(
        leases.c.state.in_([LeaseState.COMMITTED.value, LeaseState.UNDONE.value]),
        leases.c.seq > consumed,
    )


def _oldest(conn: Connection, namespace: str) -> int | None:
    """The consumption number of the namespace's oldest kept checkpoint."""
    found = conn.execute(
        sa.select(sa.func.min(checkpoints.c.consumed)).where(checkpoints.c.namespace == namespace)
    ).scalar()
    return None if found is None else int(found)


def _protected(conn: Connection, namespace: str, now: float) -> set[str]:
    """`Leases.protected` on the caller's connection."""
    found = set(conn.execute(_held(namespace, now)).scalars())
    oldest = _oldest(conn, namespace)
    if oldest is not None:
        found.update(conn.execute(_leased(namespace, _after(oldest))).scalars())
    return found


def _trim(conn: Connection, namespace: str) -> None:
    """Delete all but the namespace's newest `retention.keep_checkpoints` checkpoints
    (None: keep all), the setting read in the caller's transaction, which holds the
    namespace's lock: a change of the setting meanwhile is seen, not a stale copy."""
    settings = conn.execute(
        sa.select(namespaces.c.settings).where(namespaces.c.name == namespace)
    ).scalar()
    if settings is None:
        return
    keep = NamespaceSettings.model_validate_json(settings).retention.keep_checkpoints
    if keep is None:
        return
    c = checkpoints
    kept = (
        sa.select(c.c.step)
        .where(c.c.namespace == namespace)
        .order_by(c.c.step.desc())
        .limit(keep)
        .scalar_subquery()
    )
    conn.execute(c.delete().where(c.c.namespace == namespace, c.c.step.not_in(kept)))


def _checkpoint_of(row: Any) -> Checkpoint:
    return Checkpoint(
        row.namespace, row.step, row.epoch, row.consumed, row.policy_version, row.created_at
    )


class Leases:
    def __init__(self, db: Database) -> None:
        self._db = db

    # leases

    def take(
        self,
        namespace: str,
        pick: Pick,
        *,
        min_version: int | None,
        max_times: int | None,
        seconds: float,
        now: Now,
        epoch: int | None = None,
        holder: str | None = None,
        commit: bool = False,
        only: Sequence[str] | None = None,
        admit: Admit | None = None,
        leasing: Leasing | None = None,
    ) -> Lease:
        """Lease what `pick` chooses among the trajectories free to take (within the
        staleness window, under `max_times`, held by no open lease; of `only`, when
        given), for `seconds`. `commit`: count it at once (a plain sample), as one
        committed consumption. `epoch`, when given, must be the namespace's (`Fenced`
        otherwise). `leasing`: what `holder`'s open leases may hold (`Conflict` past
        it). `admit` sees every segment of what `pick` chose (read in the same
        transaction). Either may raise to refuse; nothing is changed then."""
        with self._db.begin() as conn:
            ns, now = _lock(conn, namespace, now)
            if epoch is not None and epoch != ns.epoch:
                raise Fenced(
                    f"epoch {epoch} is not namespace {namespace!r}'s ({ns.epoch}): it resumed "
                    "from a checkpoint since, and leases of the earlier run are refused"
                )
            chosen = pick(_candidates(conn, namespace, min_version, max_times, now, only))
            if len(set(chosen)) != len(chosen):
                raise InvalidInput("a lease names a trajectory twice")
            if leasing is not None and holder is not None and not commit:
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
                too_much = over_limits(leasing, int(count), int(held), len(chosen))
                if too_much is not None:
                    raise too_much
            if admit is not None:
                admit(lookup_in(conn, namespace, chosen))
            if commit and not chosen:
                return Lease(namespace, "0" * 32, ns.epoch, LeaseState.COMMITTED, (), now, now)
            seq = ns.consumed + 1 if commit else None
            lease = Lease(
                namespace,
                secrets.token_hex(16),
                ns.epoch,
                LeaseState.COMMITTED if commit else LeaseState.OPEN,
                tuple(chosen),
                now,
                now if commit else now + seconds,
                now if commit else None,
                seq,
                holder,
            )
            conn.execute(
                leases.insert().values(
                    namespace=namespace,
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    state=lease.state.value,
                    size=len(chosen),
                    holder=holder,
                    created_at=now,
                    expires_at=lease.expires_at,
                    closed_at=lease.closed_at,
                    seq=seq,
                )
            )
            if chosen:
                conn.execute(
                    lease_items.insert(),
                    [
                        {
                            "namespace": namespace,
                            "lease_id": lease.lease_id,
                            "position": i,
                            "trajectory_id": tid,
                        }
                        for i, tid in enumerate(chosen)
                    ],
                )
            if commit:
                conn.execute(
                    namespaces.update().where(namespaces.c.name == namespace).values(consumed=seq)
                )
                _count(conn, namespace, dict.fromkeys(chosen, 1), +1)
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
            ns, at = _lock(conn, namespace, now)
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
                conn.execute(
                    namespaces.update().where(namespaces.c.name == namespace).values(consumed=seq)
                )
                _count(conn, namespace, dict.fromkeys(lease.trajectory_ids, 1), +1)
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
            ns, at = _lock(conn, namespace, now)
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

    # checkpoints

    def checkpoint(
        self,
        namespace: str,
        step: int,
        now: Now,
        epoch: int | None = None,
    ) -> Checkpoint:
        """Record the namespace's consumption at trainer `step`; then keep only the
        newest `retention.keep_checkpoints`. The same step again, with nothing consumed since, is
        the same checkpoint; steps go forward (a step at or before the newest is a
        `Conflict`)."""
        with self._db.begin() as conn:
            ns, now = _lock(conn, namespace, now)
            if epoch is not None and epoch != ns.epoch:
                raise Fenced(
                    f"epoch {epoch} is not namespace {namespace!r}'s ({ns.epoch}): a trainer "
                    "of the run before its resume may not checkpoint"
                )
            c = checkpoints
            newest = conn.execute(
                sa.select(c).where(c.c.namespace == namespace).order_by(c.c.step.desc()).limit(1)
            ).first()
            if newest is not None and newest.step >= step:
                if newest.step == step and newest.consumed == ns.consumed:
                    return _checkpoint_of(newest)
                raise Conflict(
                    f"namespace {namespace!r} has a checkpoint at step {newest.step}, and steps "
                    f"go forward: checkpoint {step} would "
                    + ("record other consumption" if newest.step == step else "come before it")
                    + " (delete the later checkpoints first, or resume to one)"
                )
            made = Checkpoint(namespace, step, ns.epoch, ns.consumed, ns.policy_version, now)
            conn.execute(c.insert().values(**made.to_dict()))
            _trim(conn, namespace)
        return made

    def checkpoints(self, namespace: str) -> list[Checkpoint]:
        """The namespace's checkpoints, by step."""
        c = checkpoints
        query = sa.select(c).where(c.c.namespace == namespace).order_by(c.c.step)
        with self._db.connect() as conn:
            return [_checkpoint_of(r) for r in conn.execute(query)]

    def delete_checkpoint(self, namespace: str, step: int) -> None:
        c = checkpoints
        with self._db.begin() as conn:
            lock(conn, namespace)
            done = conn.execute(c.delete().where(c.c.namespace == namespace, c.c.step == step))
        if done.rowcount == 0:
            raise NotFound(f"no checkpoint at step {step} in namespace {namespace!r}")

    def resume(self, namespace: str, step: int, now: Now) -> Resumed:
        """Return the namespace's consumption to its checkpoint at `step`: every lease
        committed after it is undone (its samplings taken back), open leases are fenced
        off (their trajectories return), later checkpoints are dropped, the policy
        version and the consumption count go back to the checkpoint's, and the epoch
        moves on one (so the same step checkpointed again is the same checkpoint)."""
        with self._db.begin() as conn:
            ns, now = _lock(conn, namespace, now)
            c = checkpoints
            row = conn.execute(
                sa.select(c).where(c.c.namespace == namespace, c.c.step == step)
            ).first()
            if row is None:
                steps = conn.execute(
                    sa.select(c.c.step).where(c.c.namespace == namespace).order_by(c.c.step)
                ).scalars()
                raise NotFound(
                    f"no checkpoint at step {step} in namespace {namespace!r} "
                    f"(it has: {', '.join(map(str, steps)) or 'none'})"
                )
            point = _checkpoint_of(row)
            later = sa.and_(
                leases.c.namespace == namespace,
                leases.c.state == LeaseState.COMMITTED.value,
                leases.c.seq > point.consumed,
            )
            undone = list(conn.execute(sa.select(leases.c.lease_id).where(later)).scalars())
            counts: dict[str, int] = defaultdict(int)
            for begin in range(0, len(undone), BATCH):
                query = sa.select(lease_items.c.trajectory_id).where(
                    lease_items.c.namespace == namespace,
                    lease_items.c.lease_id.in_(undone[begin : begin + BATCH]),
                )
                for tid in conn.execute(query).scalars():
                    counts[tid] += 1
            _count(conn, namespace, counts, -1)
            conn.execute(
                leases.update().where(later).values(state=LeaseState.UNDONE.value, closed_at=now)
            )
            fenced = conn.execute(
                leases.update()
                .where(
                    leases.c.namespace == namespace,
                    leases.c.state == LeaseState.OPEN.value,
                    leases.c.expires_at > now,
                )
                .values(state=LeaseState.FENCED.value, closed_at=now)
            ).rowcount
            dropped = list(
                conn.execute(
                    sa.select(c.c.step)
                    .where(c.c.namespace == namespace, c.c.step > step)
                    .order_by(c.c.step)
                ).scalars()
            )
            conn.execute(c.delete().where(c.c.namespace == namespace, c.c.step > step))
            epoch = ns.epoch + 1
            conn.execute(
                namespaces.update()
                .where(namespaces.c.name == namespace)
                .values(epoch=epoch, policy_version=point.policy_version, consumed=point.consumed)
            )
        return Resumed(
            namespace,
            step,
            epoch,
            point.policy_version,
            len(undone),
            sum(counts.values()),
            fenced,
            dropped,
        )

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
            _trim(conn, namespace)
            ended = sa.func.coalesce(leases.c.closed_at, leases.c.expires_at) < before
            query = sa.select(leases.c.lease_id).where(leases.c.namespace == namespace, ended)
            oldest = _oldest(conn, namespace)
            if oldest is not None:  # after the oldest checkpoint: what a resume undoes or redoes
                query = query.where(~_after(oldest))
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
    """Forget the namespace's leases and checkpoints (within the caller's transaction)."""
    for table in (lease_items, leases, checkpoints):
        conn.execute(table.delete().where(table.c.namespace == namespace))
