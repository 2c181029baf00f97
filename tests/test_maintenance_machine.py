"""Two maintenance passes against a plain model (a hypothesis state machine): puts over
moving policy versions, passes of retention, compaction, rest and collection (with no
grace and no orphan age), one pass's catalog call running the other pass first or a
trainer's consumption (a lease committed, a lease released, a checkpoint resumed), and
rebuilds from the store alone. Nothing retention may keep is lost or changed, every
trajectory's sampling count is the model's whatever a pass rewrote meanwhile, and a
rebuild holds exactly what the catalog holds."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from helpers import seed_of
from r3store.engine import Engine
from r3store.engine.maintenance import Maintenance, MaintenanceOptions, MaintenanceReport
from r3store.engine.rebuild import rebuild_catalog
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore
from r3store.testing.synthetic import uniform_topk

SPEC = RouteSpec(num_layers=2, num_experts=8, top_k=2)
KEEP = 2  # policy versions retention keeps
STEPS = ["whole", "rest", "no rest"]
HOOKS = ["shards.replace", "leases.drop", "shards.retire_empty", "shards.forget"]
# what runs when the hooked call is reached: the other pass, or a trainer's step
MEANWHILE = ["pass", "commit", "release", "resume"]


def routes(tid: str, tokens: int) -> np.ndarray:
    rng = np.random.default_rng(seed_of(tid))
    return uniform_topk(rng, tokens, SPEC.num_layers, SPEC.num_experts, SPEC.top_k)


class MaintenanceMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="r3store-maintenance-"))
        self.url = f"sqlite:///{self.dir / 'catalog.db'}"
        self.store = LocalStore(self.dir / "objects")
        self.engine = Engine(self.store, Catalog(self.url))
        retention = Retention(keep_versions=KEEP)
        self.engine.namespaces.create("ns", SPEC, NamespaceSettings(retention=retention))
        self.version = 0
        self.newest = 0  # the newest policy version set: retention keeps KEEP below it
        self.model: dict[str, tuple[int, int]] = {}  # id: policy version, tokens
        self.sampled: dict[str, int] = {}  # id: times committed leases took it
        self.checkpoints: list[tuple[int, dict[str, int]]] = []  # step, counts then
        self.catalogs = [Catalog(self.url), Catalog(self.url)]
        self.passes = [
            Maintenance(
                self.store,
                catalog,
                self.engine.namespaces.spec,
                MaintenanceOptions(
                    grace_seconds=0, orphan_seconds=0, cold_seconds=0, rest_shard_bytes=4096
                ),
            )
            for catalog in self.catalogs
        ]
        self.rebuilds = 0

    def teardown(self) -> None:
        self.engine.close()
        for catalog in self.catalogs:
            catalog.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def kept(self) -> dict[str, tuple[int, int]]:
        floor = self.newest - KEEP + 1  # a resume takes the version back, not what went
        return {tid: held for tid, held in self.model.items() if held[0] >= floor}

    @rule(tokens=st.integers(2, 40), count=st.integers(1, 3))
    def put(self, tokens: int, count: int) -> None:
        writes = []
        for _ in range(count):
            tid = f"t{len(self.model)}"
            self.model[tid] = (self.version, tokens)
            writes.append(
                TrajectoryWrite(
                    tid, tokens, topk=routes(tid, tokens - 1), policy_version=self.version
                )
            )
        self.engine.put("ns", writes)

    @rule()
    def advance(self) -> None:
        self.newest = self.version = self.newest + 1
        self.engine.namespaces.set_policy_version("ns", self.version)

    def consume(self, action: str) -> None:
        """A trainer's step: a lease of every trajectory (whichever shard a pass moves
        holds some) committed or released, or a resume to the newest checkpoint (made
        first when there is none)."""
        consumption = self.engine.consumption
        if action == "resume" and self.checkpoints:
            step, counts = self.checkpoints[-1]
            resumed = consumption.resume("ns", step)
            self.version = resumed.policy_version
            self.sampled = {tid: counts.get(tid, 0) for tid in self.sampled}
        elif action == "resume":
            step = len(self.checkpoints)
            consumption.checkpoint("ns", step)
            self.checkpoints.append((step, dict(self.sampled)))
        else:
            lease = consumption.lease("ns", n=64)
            if action == "release":
                consumption.release("ns", lease.lease_id)
                return
            consumption.commit("ns", lease.lease_id)
            for tid in lease.trajectory_ids:
                self.sampled[tid] = self.sampled.get(tid, 0) + 1

    @rule(action=st.sampled_from(MEANWHILE[1:]))
    def trainer_step(self, action: str) -> None:
        self.consume(action)

    @rule(
        first=st.integers(0, 1),
        hook=st.sampled_from(HOOKS),
        kind=st.sampled_from(STEPS),
        other_kind=st.sampled_from(STEPS),
        meanwhile=st.sampled_from(MEANWHILE),
    )
    def interleaved(
        self, first: int, hook: str, kind: str, other_kind: str, meanwhile: str
    ) -> None:
        """Pass `first` runs (a whole pass, its rest step alone, or all but rest); when
        it calls `hook` on its catalog, the other pass (or a trainer's step,
        `meanwhile`) runs before the call does its work."""
        mine, other = self.passes[first], self.passes[1 - first]
        owner, method = hook.split(".")
        repository = getattr(self.catalogs[first], owner)
        real = getattr(repository, method)
        ran: list[bool] = []

        def hooked(*args: Any, **kwargs: Any) -> Any:
            if not ran:
                ran.append(True)
                if meanwhile == "pass":
                    _step(other, other_kind)
                else:
                    self.consume(meanwhile)
            return real(*args, **kwargs)

        setattr(repository, method, hooked)
        try:
            _step(mine, kind)
        finally:
            setattr(repository, method, real)

    @rule()
    def plain(self) -> None:
        self.passes[0].run()

    @rule()
    def rebuild(self) -> None:
        """A rebuild from the store alone holds what the catalog holds, exactly."""
        self.engine.flush()
        self.rebuilds += 1
        fresh = Catalog(f"sqlite:///{self.dir / f'rebuilt{self.rebuilds}.db'}")
        try:
            rebuild_catalog(self.store, fresh)
            held = set(self.engine._catalog.segments.lookup("ns", list(self.model)))
            assert set(fresh.segments.lookup("ns", list(self.model))) == held
            assert set(self.kept()) <= held
        finally:
            fresh.close()

    @invariant()
    def everything_kept_reads_back_exactly(self) -> None:
        kept = self.kept()
        batch = self.engine.get_batch("ns", list(kept))
        assert batch.missing == []
        for tid, item in zip(batch.ids, batch.items, strict=True):
            assert item is not None
            assert item.routes is not None
            tokens = kept[tid][1]
            want = np.sort(routes(tid, tokens - 1), axis=-1).astype(np.int16)
            got = item.routes.to_topk()
            assert np.array_equal(got[: tokens - 1], want), tid
        for tid, segments in self.engine._catalog.segments.lookup("ns", list(self.model)).items():
            assert segments[0].times_sampled == self.sampled.get(tid, 0), tid
        for info in self.store.list("shards/"):  # every object is the catalog's
            assert info.key in self.engine._catalog.shards.all_keys() or info.key in {
                p.key for p in self.engine._catalog.ledger.pending_uploads()
            }


def _step(maintenance: Maintenance, kind: str) -> None:
    if kind == "rest":
        maintenance.settle(MaintenanceReport())
        return
    cold = maintenance.cold_seconds
    if kind == "no rest":
        maintenance.cold_seconds = None
    try:
        maintenance.run()
    finally:
        maintenance.cold_seconds = cold


MaintenanceMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=16, deadline=None
)
test_two_maintenance_passes = MaintenanceMachine.TestCase
