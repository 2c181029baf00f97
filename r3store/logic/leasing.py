"""The rules of leases: what a lease in a given state may still do. Pure; the catalog
applies them inside the transaction that changes the lease."""

from __future__ import annotations

from r3store.errors import Fenced, LeaseClosed, LeaseCommitted, LeaseExpired, R3StoreError
from r3store.leases import Lease, LeaseState


def state_at(lease: Lease, now: float) -> LeaseState:
    """The lease's state at `now`: an open lease past its expiry reads as expired."""
    if lease.state is LeaseState.OPEN and now >= lease.expires_at:
        return LeaseState.EXPIRED
    return lease.state


def refusal(lease: Lease, epoch: int, now: float, action: str) -> R3StoreError | None:
    """Why `action` (commit, release, renew) of `lease` is refused in a namespace at
    `epoch`, or None when it may go ahead. A commit that already happened answers
    `LeaseCommitted` whatever the epoch since: it was counted, and stays counted."""
    name = f"lease {lease.lease_id}"
    state = state_at(lease, now)
    if state is LeaseState.COMMITTED:
        return LeaseCommitted(f"{name} was committed already (consumption number {lease.seq})")
    if state is LeaseState.UNDONE:
        return Fenced(f"{name} was committed, then undone when the namespace resumed")
    if state is LeaseState.FENCED or lease.epoch != epoch:
        return Fenced(
            f"{name} belongs to epoch {lease.epoch}, and namespace {lease.namespace!r} "
            f"resumed from a checkpoint since (epoch {epoch}): it may not {action}"
        )
    if state is LeaseState.RELEASED:
        return LeaseClosed(f"{name} was released: it may not {action}")
    if state is LeaseState.EXPIRED:
        return LeaseExpired(
            f"{name} expired {now - lease.expires_at:.1f} s ago: its trajectories went back "
            f"to the pool uncounted, and it may not {action} (take a new lease)"
        )
    return None
