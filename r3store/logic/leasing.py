"""The rules of leases: what a lease in a given state may still do. Pure; the catalog
applies them inside the transaction that changes the lease."""

from __future__ import annotations

from r3store.errors import (
    Conflict,
    Fenced,
    Forbidden,
    LeaseClosed,
    LeaseCommitted,
    LeaseExpired,
    R3StoreError,
)
from r3store.leases import Lease, LeaseState
from r3store.policy import Leasing


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


def not_holder(lease: Lease, by: str | None, action: str) -> Forbidden | None:
    """Why key `by` may not `action` `lease`: another key took it. None when `by` took
    it, or is None (a caller that may act on any lease: an admin, the engine itself)."""
    if by is None or lease.holder is None or lease.holder == by:
        return None
    return Forbidden(
        f"lease {lease.lease_id} was taken by another API key: only that key (or an admin) "
        f"may {action} it"
    )


def over_limits(leasing: Leasing, open_leases: int, held: int, taking: int) -> Conflict | None:
    """Why a key whose open leases are `open_leases`, holding `held` trajectories, may
    not take one more of `taking` trajectories under the namespace's `leasing`."""
    if leasing.max_open is not None and open_leases + 1 > leasing.max_open:
        return Conflict(
            f"this API key holds {open_leases} open leases, the namespace's limit "
            f"(leasing.max_open): commit or release one first"
        )
    if leasing.max_held is not None and held + taking > leasing.max_held:
        return Conflict(
            f"this API key's open leases hold {held} trajectories; {taking} more would pass "
            f"the namespace's limit of {leasing.max_held} (leasing.max_held)"
        )
    return None
