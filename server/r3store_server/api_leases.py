"""Consumption by trainers: leases, step checkpoints and resume (docs/api.md, "Leases and
checkpoints"). Taking leases is a reader's (as sampling is); reading, committing,
releasing and renewing one is the key's that took it (or an admin's: `manage`), and
a reader lists its own open leases only. Checkpoints and resume are a trainer's or an
admin's."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Path

from r3store.engine.consumption import Consumption
from r3store.errors import StoreError
from r3store.leases import LEASE_ID, MAX_STEP, Lease
from r3store.protocol.consumption import (
    CheckpointDeleted,
    CheckpointList,
    CheckpointModel,
    CheckpointRequest,
    CommitRequest,
    LeaseList,
    LeaseModel,
    LeaseRequest,
    RenewRequest,
    ResumedModel,
)
from r3store_server.auth import Principal
from r3store_server.deps import NamespaceAt, NamespaceDep, PrincipalDep, allowed
from r3store_server.errors import ERROR_RESPONSES

log = logging.getLogger("r3store.server")
router = APIRouter(prefix="/v1/namespaces", tags=["leases"], responses=ERROR_RESPONSES)


def holder(who: Principal, namespace: str) -> str | None:
    """Whose leases `who` may act on: its own, or (an admin) anyone's."""
    return None if who.may("manage", namespace) else who.name


LeasePath = Path(pattern=LEASE_ID.pattern, description="the lease")
StepPath = Path(ge=0, le=MAX_STEP, description="the trainer step")


@dataclass(frozen=True)
class LeaseAt:
    """The lease a request names, in its namespace (`at`), and whose leases its key may
    act on (`holder`)."""

    at: NamespaceAt
    lease_id: str
    holder: str | None

    @property
    def consumption(self) -> Consumption:
        return self.at.engine.consumption

    async def act(self, call: Callable[..., Lease], *args: object) -> LeaseModel:
        """`call(namespace, lease_id, *args, holder)` off the event loop, within the
        request's deadline: the lease as it leaves it."""
        lease = await self.at.run(call, self.lease_id, *args, self.holder)
        return LeaseModel.of(lease)


async def lease_at(at: NamespaceDep, who: PrincipalDep, lease_id: str = LeasePath) -> LeaseAt:
    """The lease the path names, as the key may act on it."""
    return LeaseAt(at, lease_id, holder(who, at.namespace))


LeaseAtDep = Annotated[LeaseAt, Depends(lease_at)]


@router.post(
    "/{namespace}/leases",
    status_code=201,
    response_model=LeaseModel,
    dependencies=[allowed("read")],
)
async def take_lease(body: LeaseRequest, at: NamespaceDep, who: PrincipalDep) -> LeaseModel:
    """Lease up to `n` trajectories (chosen as a sample chooses them) or exactly
    `trajectory_ids` (409 unless each is free: stored, not stale, under the sampling cap,
    held by no open lease) for `seconds`. Nothing is counted until the commit; the
    ranks read their slices with `routes/batch`. `epoch`: refused (409 `fenced`) once
    the namespace resumed since. Not idempotent (the client does not retry it)."""

    def answered(_found: object) -> None:
        """Refuse to record a lease once the request was answered (its deadline passed):
        nobody would hold it, and it would keep its trajectories from the next one."""
        if at.deadline.cancelled.is_set():
            log.warning(
                "a lease of namespace %r was not recorded: its request was answered (past "
                "its deadline) before the catalog took it",
                at.namespace,
            )
            raise StoreError("the lease was not recorded: its request was answered already")

    def take(namespace: str) -> LeaseModel:
        # the request's fields are the lease's arguments of the same names
        lease = at.engine.consumption.lease(
            namespace, **dict(body), holder=who.name, admit=answered
        )
        return LeaseModel.of(lease)

    return await at.run(take, what="the lease")


@router.get("/{namespace}/leases", response_model=LeaseList, dependencies=[allowed("read")])
async def open_leases(at: NamespaceDep, who: PrincipalDep) -> LeaseList:
    """The namespace's open, unexpired leases that this key took (an admin: all of
    them), oldest first, and its epoch."""

    def listed(namespace: str) -> LeaseList:
        found = at.engine.consumption.open_leases(namespace, holder(who, namespace))
        epoch = at.engine.consumption.epoch(namespace)
        return LeaseList(epoch=epoch, leases=[LeaseModel.of(lease) for lease in found])

    return await at.run(listed)


@router.get(
    "/{namespace}/leases/{lease_id}", response_model=LeaseModel, dependencies=[allowed("read")]
)
async def get_lease(lease: LeaseAtDep) -> LeaseModel:
    """A lease and its state (past its expiry: `expired`); 404 once forgotten (a day
    after it closed); 403 for a lease another key took."""
    return await lease.act(lease.consumption.get)


@router.post(
    "/{namespace}/leases/{lease_id}/commit",
    response_model=LeaseModel,
    dependencies=[allowed("read")],
)
async def commit_lease(lease: LeaseAtDep, body: CommitRequest | None = None) -> LeaseModel:
    """Count each of the lease's trajectories as sampled once (after the trainer's step).
    409 `lease_committed` when committed before (unless with the same `token`: a retry,
    answered again), `lease_expired` past its expiry, `lease_closed` when released,
    `fenced` for a lease of an epoch before a resume; 403 for a lease another key took;
    nothing changes then."""
    token = None if body is None else body.token
    return await lease.act(lease.consumption.commit, token)


@router.post(
    "/{namespace}/leases/{lease_id}/release",
    response_model=LeaseModel,
    dependencies=[allowed("read")],
)
async def release_lease(lease: LeaseAtDep) -> LeaseModel:
    """Give the lease's trajectories back to the pool uncounted (a step abandoned); 403
    for a lease another key took."""
    return await lease.act(lease.consumption.release)


@router.post(
    "/{namespace}/leases/{lease_id}/renew",
    response_model=LeaseModel,
    dependencies=[allowed("read")],
)
async def renew_lease(body: RenewRequest, lease: LeaseAtDep) -> LeaseModel:
    """Hold an open, unexpired lease `seconds` from now (a long step; at most the
    namespace's `leasing.max_seconds`); 403 for a lease another key took."""
    return await lease.act(lease.consumption.renew, body.seconds)


@router.post(
    "/{namespace}/checkpoints",
    response_model=CheckpointModel,
    dependencies=[allowed("checkpoint")],
)
async def checkpoint(body: CheckpointRequest, at: NamespaceDep) -> CheckpointModel:
    """Record the namespace's consumption at trainer `step` (after its commit), keeping
    the newest `retention.keep_checkpoints`. The same step again with nothing consumed
    since answers the same checkpoint; a step at or before the newest with other
    consumption, 409. `epoch`: refused (409 `fenced`) once resumed since. Trainer or
    admin."""
    point = await at.run(at.engine.consumption.checkpoint, body.step, body.epoch)
    return CheckpointModel.of(point)


@router.get(
    "/{namespace}/checkpoints", response_model=CheckpointList, dependencies=[allowed("read")]
)
async def checkpoints(at: NamespaceDep) -> CheckpointList:
    """The namespace's checkpoints by step, and its epoch."""

    def listed(namespace: str) -> CheckpointList:
        found = at.engine.consumption.checkpoints(namespace)
        epoch = at.engine.consumption.epoch(namespace)
        return CheckpointList(epoch=epoch, checkpoints=[CheckpointModel.of(c) for c in found])

    return await at.run(listed)


@router.delete(
    "/{namespace}/checkpoints/{step}",
    response_model=CheckpointDeleted,
    dependencies=[allowed("checkpoint")],
)
async def delete_checkpoint(at: NamespaceDep, step: int = StepPath) -> CheckpointDeleted:
    """Forget a checkpoint (routes only it kept become retention's again). Trainer or
    admin."""
    await at.run(at.engine.consumption.delete_checkpoint, step)
    return CheckpointDeleted(namespace=at.namespace, step=step)


@router.post(
    "/{namespace}/checkpoints/{step}/resume",
    response_model=ResumedModel,
    dependencies=[allowed("checkpoint")],
)
async def resume(at: NamespaceDep, step: int = StepPath) -> ResumedModel:
    """After a crash: the namespace's consumption returns to its checkpoint at `step`.
    Leases committed after it are undone (their trajectories available again, in the
    same FIFO order), open ones fenced, later checkpoints dropped, the policy version
    set back to the checkpoint's, and the epoch moves on (leases and checkpoints of the
    earlier epoch are refused). Not idempotent: each resume starts a new epoch. Trainer
    or admin."""
    return ResumedModel.of(await at.run(at.engine.consumption.resume, step))
