"""Consumption by trainers, as plain values: leases, step checkpoints and what a resume
did (docs/api.md, "Leases and checkpoints").

A trainer takes a batch under a `Lease`: its trajectories are held (no other lease or
sample takes them) until it is committed (each counts one sampling then), released or
expired (they return to the pool uncounted). A `Checkpoint` records a namespace's
consumption at a trainer step; resuming to it undoes every consumption committed after
it and starts a new `epoch`, which fences off leases of the trainer's previous
incarnation. The server, the client and the CLI share these; `to_dict` is their wire
form (`r3store.protocol.consumption` reads it back; `Lease.from_dict` too).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

from r3store.errors import InvalidInput

LEASE_ID = re.compile(r"^[0-9a-f]{32}$")
MAX_LEASE_SECONDS = 7 * 86400.0  # a week: longer than any trainer step
DEFAULT_LEASE_SECONDS = 600.0
MAX_STEP = 2**63 - 1
MAX_LEASE_IDS = 10_000  # trajectories a lease names (and, over HTTP, takes)


class LeaseState(StrEnum):
    OPEN = "open"  # held until it expires
    COMMITTED = "committed"  # counted
    RELEASED = "released"  # given back uncounted
    FENCED = "fenced"  # open when its namespace resumed: given back, never committable
    UNDONE = "undone"  # committed, then undone by a resume to an earlier checkpoint
    EXPIRED = "expired"  # past its expiry: given back uncounted (an open lease past its
    # expiry reads as expired before the catalog marks it so)


@dataclass(frozen=True)
class Lease:
    namespace: str
    lease_id: str
    epoch: int
    state: LeaseState
    trajectory_ids: tuple[str, ...]  # in the order taken (FIFO: oldest first)
    created_at: float
    expires_at: float
    closed_at: float | None = None
    seq: int | None = None  # its place in the namespace's consumption, once committed
    holder: str | None = None  # the key that took it

    def slice(self, rank: int, world: int) -> tuple[str, ...]:
        """The trajectories of data-parallel `rank` of `world`: contiguous, in order, the
        first `len % world` ranks one more."""
        if world < 1 or not 0 <= rank < world:
            raise InvalidInput(f"rank {rank} of world {world}: need 0 <= rank < world")
        base, extra = divmod(len(self.trajectory_ids), world)
        begin = rank * base + min(rank, extra)
        return self.trajectory_ids[begin : begin + base + (rank < extra)]

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["state"] = str(self.state)
        data["trajectory_ids"] = list(self.trajectory_ids)
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Lease:
        try:
            return cls(
                namespace=str(data["namespace"]),
                lease_id=str(data["lease_id"]),
                epoch=int(data["epoch"]),
                state=LeaseState(data["state"]),
                trajectory_ids=tuple(str(t) for t in data["trajectory_ids"]),
                created_at=float(data["created_at"]),
                expires_at=float(data["expires_at"]),
                closed_at=None if data.get("closed_at") is None else float(data["closed_at"]),
                seq=None if data.get("seq") is None else int(data["seq"]),
                holder=None if data.get("holder") is None else str(data["holder"]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidInput(f"not a lease: {exc}") from None


@dataclass(frozen=True)
class Checkpoint:
    """A namespace's consumption at a trainer step: every lease committed up to the
    namespace's `consumed`-th, and its policy version then."""

    namespace: str
    step: int
    epoch: int
    consumed: int
    policy_version: int
    created_at: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class Resumed:
    """What `resume` did: the new epoch, the leases undone (committed after the
    checkpoint) and the samplings they counted, the open leases fenced off, and the
    later checkpoints dropped (the timeline they record no longer exists)."""

    namespace: str
    step: int
    epoch: int
    policy_version: int
    leases_undone: int
    samplings_undone: int
    leases_fenced: int
    checkpoints_dropped: list[int]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def check_lease_id(lease_id: object) -> str:
    if not isinstance(lease_id, str) or not LEASE_ID.match(lease_id):
        raise InvalidInput(f"a lease id is 32 lower-case hex digits, got {lease_id!r}")
    return lease_id


def check_step(step: object) -> int:
    if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step <= MAX_STEP:
        raise InvalidInput(f"a step is an integer in [0, 2**63), got {step!r}")
    return step


def check_lease_seconds(seconds: object) -> float:
    if (
        isinstance(seconds, bool)
        or not isinstance(seconds, int | float)
        or not 0 < seconds <= MAX_LEASE_SECONDS
    ):
        raise InvalidInput(
            f"a lease lasts more than 0 and at most {MAX_LEASE_SECONDS:.0f} seconds, "
            f"got {seconds!r}"
        )
    return float(seconds)
