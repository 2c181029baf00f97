"""What leases (`leases`) and checkpoints (`checkpoints`) share: the lock every change
to a namespace's consumption takes first, the epoch fence, sampling counts, and which
committed leases the oldest kept checkpoint still covers.

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

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from r3store.errors import Fenced, NotFound
from r3store.leases import LeaseState
from r3store.policy import ENGINE, NamespaceSettings
from r3store.storage.catalog.database import BATCH, lock
from r3store.storage.catalog.tables import checkpoints, leases, namespaces, trajectories

# the time of a change: a clock, read once the namespace is locked (a wait for the lock
# must not stretch a lease past its expiry), or a fixed time (tests)
Now = float | Callable[[], float]


def lock_consumption(conn: Connection, namespace: str, now: Now) -> tuple[Any, float]:
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


def lock_in_epoch(
    conn: Connection, namespace: str, now: Now, epoch: int | None, refused: str
) -> tuple[Any, float]:
    """`lock_consumption`, refused (`Fenced`, saying `refused`) when `epoch` is given and
    is not the namespace's."""
    ns, at = lock_consumption(conn, namespace, now)
    if epoch is not None and epoch != ns.epoch:
        raise Fenced(f"epoch {epoch} is not namespace {namespace!r}'s ({ns.epoch}): {refused}")
    return ns, at


def count_samplings(conn: Connection, namespace: str, counts: dict[str, int], sign: int) -> None:
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


def committed_after(consumed: int) -> sa.ColumnElement[bool]:
    """Leases committed after consumption number `consumed`, still or undone since."""
    return sa.and_(
        leases.c.state.in_([LeaseState.COMMITTED.value, LeaseState.UNDONE.value]),
        leases.c.seq > consumed,
    )


def oldest_kept(conn: Connection, namespace: str) -> int | None:
    """The consumption number of the namespace's oldest kept checkpoint."""
    found = conn.execute(
        sa.select(sa.func.min(checkpoints.c.consumed)).where(checkpoints.c.namespace == namespace)
    ).scalar()
    return None if found is None else int(found)


def trim(conn: Connection, namespace: str) -> None:
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
