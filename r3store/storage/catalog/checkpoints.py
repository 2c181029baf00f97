"""Step checkpoints and resume (`catalog.checkpoints`): a checkpoint records the
namespace's consumption number at a trainer step; resuming to it undoes the leases
committed after it, fences off the open ones and starts a new epoch. Each change locks
the namespace's row first, as the leases' do (`consumption`).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.errors import Conflict, NotFound
from r3store.leases import Checkpoint, LeaseState, Resumed
from r3store.storage.catalog.consumption import (
    Now,
    count_samplings,
    lock_consumption,
    lock_in_epoch,
    trim,
)
from r3store.storage.catalog.database import BATCH, Repository, lock
from r3store.storage.catalog.tables import checkpoints, lease_items, leases, namespaces

# why a checkpoint of an earlier epoch is refused (`Fenced`)
_BEFORE_RESUME = "a trainer of the run before its resume may not checkpoint"


def _checkpoint_of(row: Any) -> Checkpoint:
    return Checkpoint(
        row.namespace, row.step, row.epoch, row.consumed, row.policy_version, row.created_at
    )


def _undo_after(conn: Connection, namespace: str, consumed: int, now: float) -> tuple[int, int]:
    """Undo the namespace's leases committed after consumption number `consumed`, their
    samplings taken back; returns the leases and the samplings undone."""
    later = sa.and_(
        leases.c.namespace == namespace,
        leases.c.state == LeaseState.COMMITTED.value,
        leases.c.seq > consumed,
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
    count_samplings(conn, namespace, counts, -1)
    conn.execute(leases.update().where(later).values(state=LeaseState.UNDONE.value, closed_at=now))
    return len(undone), sum(counts.values())


class Checkpoints(Repository):
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
            ns, now = lock_in_epoch(conn, namespace, now, epoch, _BEFORE_RESUME)
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
            trim(conn, namespace)
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
            ns, now = lock_consumption(conn, namespace, now)
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
            undone, samplings = _undo_after(conn, namespace, point.consumed, now)
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
            namespace, step, epoch, point.policy_version, undone, samplings, fenced, dropped
        )


def delete_namespace(conn: Connection, namespace: str) -> None:
    """Forget the namespace's checkpoints (within the caller's transaction)."""
    conn.execute(checkpoints.delete().where(checkpoints.c.namespace == namespace))
