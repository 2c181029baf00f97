"""The client's calls for consumption by trainers: leases, step checkpoints and resume
(docs/api.md, "Leases and checkpoints"), written once as step generators like every
other call (`r3store_client.calls`), run blocking by `Client` and awaited by
`AsyncClient`.

    lease = client.lease("run1", n=64, seconds=600)        # nothing counted yet
    batch = client.read_lease(lease, rank, world)          # each rank its slice
    client.commit(lease)                                   # one rank, after the step
    client.checkpoint("run1", step)                        # with the trainer's checkpoint
    done = client.resume("run1", step)                     # after a crash; done.epoch

A `Lease` is a plain value (picklable, `to_dict`): rank 0 takes it and broadcasts it.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from typing import Any

from r3store.errors import LeaseClosed
from r3store.leases import (
    DEFAULT_LEASE_SECONDS,
    Checkpoint,
    Lease,
    LeaseState,
    Resumed,
    check_step,
)
from r3store.logic.sampling import Strategy
from r3store.policy import Source
from r3store.protocol.consumption import (
    CheckpointList,
    CheckpointModel,
    LeaseList,
    LeaseModel,
    ResumedModel,
)
from r3store.protocol.wire import ReadFormat
from r3store.records import Batch
from r3store_client.read_calls import ReadCalls
from r3store_client.steps import Call


class LeaseCalls(ReadCalls):
    """Leases, checkpoints and resume; mixed into `Calls`. A lease's routes are read as
    `get_batch` reads them (`read_calls`)."""

    def _lease(
        self,
        namespace: str,
        n: int | None = None,
        trajectory_ids: Sequence[str] | None = None,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        seed: int | None = None,
        seconds: float = DEFAULT_LEASE_SECONDS,
        epoch: int | None = None,
    ) -> Call[Lease]:
        """Lease up to `n` trajectories (chosen as `sample` chooses them), or exactly
        `trajectory_ids` (`Conflict` unless each is free to take), for `seconds`: held
        from other leases and samples, counted only by `commit`. `epoch` (the one
        `resume` answered): refused with `Fenced` once the namespace resumed again.
        Not retried after it may have reached the server (a retry would hold twice)."""
        body: dict[str, Any] = {"seconds": seconds}
        if n is not None:
            body.update(n=n, strategy=str(strategy), whole_groups=whole_groups, seed=seed)
        if trajectory_ids is not None:
            body["trajectory_ids"] = list(trajectory_ids)
        if epoch is not None:
            body["epoch"] = epoch
        path = f"/v1/namespaces/{namespace}/leases"
        answer = yield from self._json("POST", path, json=body, idempotent=False)
        return LeaseModel.model_validate(answer).root

    def _read_lease(
        self,
        lease: Lease,
        rank: int = 0,
        world: int = 1,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Call[Batch]:
        """The routes of data-parallel `rank`'s slice of the lease (`Lease.slice`:
        contiguous, in the lease's order), read as `get_batch` reads them."""
        ids = lease.slice(rank, world)
        if not ids:
            return Batch([], [], [], [])
        return (
            yield from self._get_batch(
                lease.namespace, list(ids), False, fmt, decode, source, layers
            )
        )

    def _lease_path(self, lease: Lease, action: str = "") -> str:
        tail = f"/{action}" if action else ""
        return f"/v1/namespaces/{lease.namespace}/leases/{lease.lease_id}{tail}"

    def _commit(self, lease: Lease) -> Call[Lease]:
        """Count each of the lease's trajectories as sampled once: call it after the
        step trained on them. Retried safely (its retries carry the first attempt's
        token and are answered as it was); a second commit of the lease raises
        `LeaseCommitted`, an expired one `LeaseExpired`, a released one `LeaseClosed`,
        one of the run before a resume `Fenced`: nothing is counted then."""
        body = {"token": secrets.token_hex(16)}
        answer = yield from self._json("POST", self._lease_path(lease, "commit"), json=body)
        return LeaseModel.model_validate(answer).root

    def _release(self, lease: Lease) -> Call[Lease]:
        """Give the lease's trajectories back uncounted (a step abandoned). A lease
        released already (a retry whose first answer was lost) is answered as it is."""
        try:
            answer = yield from self._json("POST", self._lease_path(lease, "release"))
        except LeaseClosed:
            now = yield from self._get_lease(lease)
            if now.state is not LeaseState.RELEASED:
                raise
            return now
        return LeaseModel.model_validate(answer).root

    def _renew(self, lease: Lease, seconds: float = DEFAULT_LEASE_SECONDS) -> Call[Lease]:
        """Hold the lease `seconds` from now (an open one, before it expires)."""
        path = self._lease_path(lease, "renew")
        answer = yield from self._json("POST", path, json={"seconds": seconds})
        return LeaseModel.model_validate(answer).root

    def _get_lease(self, lease: Lease) -> Call[Lease]:
        """The lease as the server has it now (its state, expiry, consumption number)."""
        answer = yield from self._json("GET", self._lease_path(lease))
        return LeaseModel.model_validate(answer).root

    def _leases(self, namespace: str) -> Call[tuple[int, list[Lease]]]:
        """The namespace's epoch and its open, unexpired leases, oldest first."""
        answer = yield from self._json("GET", f"/v1/namespaces/{namespace}/leases")
        found = LeaseList.model_validate(answer)
        return found.epoch, [model.root for model in found.leases]

    def _checkpoint(self, namespace: str, step: int, epoch: int | None = None) -> Call[Checkpoint]:
        """Record the namespace's consumption at trainer `step` (after its commit, with
        the trainer's own checkpoint); the same step again is the same checkpoint. A
        trainer or admin key."""
        body: dict[str, Any] = {"step": check_step(step)}
        if epoch is not None:
            body["epoch"] = epoch
        path = f"/v1/namespaces/{namespace}/checkpoints"
        answer = yield from self._json("POST", path, json=body)
        return CheckpointModel.model_validate(answer).root

    def _checkpoints(self, namespace: str) -> Call[tuple[int, list[Checkpoint]]]:
        """The namespace's epoch and its checkpoints, by step."""
        answer = yield from self._json("GET", f"/v1/namespaces/{namespace}/checkpoints")
        found = CheckpointList.model_validate(answer)
        return found.epoch, [model.root for model in found.checkpoints]

    def _delete_checkpoint(self, namespace: str, step: int) -> Call[None]:
        """Forget the checkpoint at `step`."""
        path = f"/v1/namespaces/{namespace}/checkpoints/{check_step(step)}"
        yield from self._json("DELETE", path)

    def _resume(self, namespace: str, step: int) -> Call[Resumed]:
        """After a crash: return the namespace's consumption to its checkpoint at
        `step` (what was consumed after it is available again, in the same FIFO order)
        and start a new epoch, which fences off the earlier run's leases. Pass the
        answer's `epoch` to `lease` and `checkpoint`. Not retried after it may have
        reached the server (each resume starts an epoch)."""
        path = f"/v1/namespaces/{namespace}/checkpoints/{check_step(step)}/resume"
        answer = yield from self._json("POST", path, idempotent=False)
        return ResumedModel.model_validate(answer).root
