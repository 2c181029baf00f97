"""Consumption by trainers, the engine's part for it (`Engine.consumption`): leases,
step checkpoints and resume (docs/api.md, "Leases and checkpoints").

    lease = engine.consumption.lease("run1", n=64, seconds=600)
    batch = engine.get_batch("run1", lease.slice(rank, world))   # each rank its slice
    engine.consumption.commit("run1", lease.lease_id)            # after the step: counted
    engine.consumption.checkpoint("run1", step=10)
    engine.consumption.resume("run1", step=10)                   # after a crash

A lease holds its trajectories (no other lease or sample takes them) and counts them
(times sampled, `max_times_sampled`, eviction after sampling, FIFO order) only when
committed; released or expired, they return to the pool. A resume undoes what was
committed after the checkpoint and starts a new epoch: what the earlier run holds or
commits after it is refused (`Fenced`).
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Sequence

from r3store.catalog_types import TrajectoryEntry
from r3store.engine.namespaces import Namespaces
from r3store.errors import Conflict, InvalidInput
from r3store.leases import (
    DEFAULT_LEASE_SECONDS,
    MAX_LEASE_IDS,
    Checkpoint,
    Lease,
    Resumed,
    check_lease_id,
    check_lease_seconds,
    check_step,
)
from r3store.logic.leasing import not_holder, state_at
from r3store.logic.sampling import Candidate, Strategy, choose
from r3store.logic.sources import choose_source
from r3store.policy import Leasing, Source, staleness_floor
from r3store.records import check_id
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.leases import Admit, Pick, Terms
from r3store.storage.catalog.leases import Candidate as Row

MAX_LEASE_SIZE = 1 << 20  # trajectories one lease takes


def _sampled(n: int, strategy: Strategy, whole_groups: bool, seed: int | None) -> Pick:
    """Choose up to `n` of the candidates (`r3store.logic.sampling.choose`)."""

    def pick(rows: list[Row]) -> list[str]:
        candidates = [Candidate(tid, group, created) for tid, group, created in rows]
        return choose(candidates, n, strategy, whole_groups, random.Random(seed))

    return pick


def _named(ids: Sequence[str], namespace: str) -> Pick:
    """Exactly `ids`, refused unless every one is free to take."""

    def pick(rows: list[Row]) -> list[str]:
        free = {r[0] for r in rows}
        taken = [tid for tid in ids if tid not in free]
        if taken:
            shown = ", ".join(repr(t) for t in taken[:5])
            raise Conflict(
                f"{len(taken)} of the trajectories to lease in {namespace!r} are not free to "
                f"take ({shown}{', ...' if len(taken) > 5 else ''}): held by an open lease, "
                "sampled max_times_sampled times, stale, or not stored"
            )
        return list(ids)

    return pick


class Consumption:
    """Leases, checkpoints and resume over one catalog."""

    def __init__(
        self, catalog: Catalog, namespaces: Namespaces, clock: Callable[[], float]
    ) -> None:
        self._catalog = catalog
        self._namespaces = namespaces
        self._clock = clock

    def lease(
        self,
        namespace: str,
        n: int | None = None,
        trajectory_ids: Sequence[str] | None = None,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        seed: int | None = None,
        seconds: float = DEFAULT_LEASE_SECONDS,
        epoch: int | None = None,
        holder: str | None = None,
        admit: Admit | None = None,
        commit: bool = False,
    ) -> Lease:
        """Lease up to `n` trajectories chosen as `sample` chooses them (FIFO, uniform,
        whole groups), or exactly `trajectory_ids` (`Conflict` unless each is stored,
        within the staleness window, under `max_times_sampled` and held by no open
        lease), for `seconds`. `epoch`: the caller's, refused (`Fenced`) when the
        namespace resumed since. `admit` sees the chosen trajectories' segments (every
        source) before anything is recorded and may refuse by raising. `commit`:
        counted at once (a sample)."""
        if (n is None) == (trajectory_ids is None):
            raise InvalidInput("a lease takes either n trajectories or trajectory_ids, not both")
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise InvalidInput(f"n must be a positive integer, got {n!r}")
        if n is not None and n > MAX_LEASE_SIZE:
            raise InvalidInput(f"a lease takes at most {MAX_LEASE_SIZE} trajectories, not {n}")
        seconds = check_lease_seconds(seconds)
        info = self._namespaces.get(namespace)
        _within(seconds, info.settings.leasing)
        only = None
        if trajectory_ids is not None:
            ids = [check_id(t) for t in trajectory_ids]
            if len(set(ids)) != len(ids):
                raise InvalidInput("trajectory_ids names a trajectory twice")
            if not ids or len(ids) > MAX_LEASE_IDS:
                raise InvalidInput(f"a lease names 1 to {MAX_LEASE_IDS} trajectories")
            pick, only = _named(ids, namespace), ids
        else:
            assert n is not None
            pick = _sampled(n, strategy, whole_groups, seed)
        terms = Terms(
            min_version=staleness_floor(info.policy_version, info.settings),
            max_times=info.settings.max_times_sampled,
            seconds=seconds,
            epoch=epoch,
            holder=holder,
            commit=commit,
            only=only,
            admit=admit,
            leasing=info.settings.leasing,
        )
        return self._catalog.leases.take(namespace, pick, terms, self._clock)

    def get(self, namespace: str, lease_id: str, by: str | None = None) -> Lease:
        """The lease as it stands now (open past its expiry reads as expired); `by`: the
        key asking (`Forbidden` for another key's lease; None: any)."""
        self._namespaces.get(namespace)
        lease = self._catalog.leases.get(namespace, check_lease_id(lease_id))
        foreign = not_holder(lease, by, "read")
        if foreign is not None:
            raise foreign
        return dataclasses.replace(lease, state=state_at(lease, self._clock()))

    def commit(
        self, namespace: str, lease_id: str, token: str | None = None, by: str | None = None
    ) -> Lease:
        """Count the lease's trajectories as sampled once (see `Leases.commit`); `token`
        (32 hex digits, a retry sends the same) makes a retried commit succeed again.
        `by`: the key asking, refused (`Forbidden`) unless it took the lease (None:
        any, an admin's)."""
        self._namespaces.get(namespace)
        if token is not None:
            check_lease_id(token)
        return self._catalog.leases.commit(
            namespace, check_lease_id(lease_id), self._clock, token, by
        )

    def release(self, namespace: str, lease_id: str, by: str | None = None) -> Lease:
        self._namespaces.get(namespace)
        return self._catalog.leases.release(namespace, check_lease_id(lease_id), self._clock, by)

    def renew(self, namespace: str, lease_id: str, seconds: float, by: str | None = None) -> Lease:
        info = self._namespaces.get(namespace)
        seconds = check_lease_seconds(seconds)
        _within(seconds, info.settings.leasing)
        return self._catalog.leases.renew(
            namespace, check_lease_id(lease_id), seconds, self._clock, by
        )

    def open_leases(self, namespace: str, by: str | None = None) -> list[Lease]:
        """The namespace's open leases; `by`: only those that key took (None: all)."""
        self._namespaces.get(namespace)
        return self._catalog.leases.open(namespace, self._clock(), holder=by)

    def epoch(self, namespace: str) -> int:
        """The namespace's epoch: 0, and one more at each resume."""
        return self._catalog.leases.epoch(namespace)[0]

    def checkpoint(self, namespace: str, step: int, epoch: int | None = None) -> Checkpoint:
        """Record the namespace's consumption at trainer `step`, keeping the newest
        `retention.keep_checkpoints`."""
        self._namespaces.get(namespace)
        return self._catalog.checkpoints.checkpoint(namespace, check_step(step), self._clock, epoch)

    def checkpoints(self, namespace: str) -> list[Checkpoint]:
        self._namespaces.get(namespace)
        return self._catalog.checkpoints.checkpoints(namespace)

    def delete_checkpoint(self, namespace: str, step: int) -> None:
        self._namespaces.get(namespace)
        self._catalog.checkpoints.delete_checkpoint(namespace, check_step(step))

    def resume(self, namespace: str, step: int) -> Resumed:
        """Return the namespace's consumption to its checkpoint at `step` (see
        `Checkpoints.resume`); the manifest records the policy version it goes back to."""
        self._namespaces.get(namespace)
        done = self._catalog.checkpoints.resume(namespace, check_step(step), self._clock)
        self._namespaces.write_manifest(namespace)
        return done

    def protected(self, namespace: str) -> set[str]:
        """What retention must keep (`Leases.protected`)."""
        return self._catalog.leases.protected(namespace, self._clock())


def _within(seconds: float, leasing: Leasing) -> None:
    if seconds > leasing.max_seconds:
        raise InvalidInput(
            f"a lease of {seconds:g} s: the namespace holds leases at most "
            f"{leasing.max_seconds:g} s (leasing.max_seconds); renew it during a long step"
        )


def admitting(wanted: Sequence[Source], admit: Callable[[list[TrajectoryEntry]], None]) -> Admit:
    """An `Admit` over every segment of a lease's trajectories, from one over the
    segments each is served from (the first of `wanted` it holds for all its tokens)."""

    def check(found: dict[str, list[TrajectoryEntry]]) -> None:
        served = (choose_source(segments, wanted) for segments in found.values())
        admit([s for chosen in served if chosen is not None for s in chosen[1]])

    return check
