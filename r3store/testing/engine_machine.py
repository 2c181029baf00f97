"""The engine against a plain model of what it should hold (a hypothesis state machine):
puts, retries, conflicts, appended turns, policy versions and the staleness window,
retention with compaction and collection, and catalog rebuilds from the store alone.

A backend author runs it over their object store and catalog::

    TestMine = engine_machine(
        lambda root: MyStore(...),  # the same objects each time for one `root`
        lambda root, name: MyCatalog(...),  # a new, empty catalog per `name`
    ).TestCase

`open_store(root)` opens the machine's object store (`root`: a fresh temporary
folder per run, removed after it; every call must see the same objects);
`open_catalog(root, name)` opens the catalog called `name` (a new, empty one for each
name: the engine's first, then one per rebuild). Needs hypothesis.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.engine.rebuild import rebuild_catalog
from r3store.errors import Conflict, StalePolicy
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore
from r3store.storage.store.base import ObjectStore
from r3store.testing.synthetic import uniform_topk

StoreFactory = Callable[[Path], ObjectStore]
CatalogFactory = Callable[[Path, str], Catalog]

SPEC = RouteSpec(num_layers=2, num_experts=8, top_k=2)
IDS = st.sampled_from([f"t{i}" for i in range(6)])


def seed_of(key: str) -> int:
    return int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little")


def routes(key: str, tokens: int) -> npt.NDArray[Any]:
    rng = np.random.default_rng(seed_of(key))
    return uniform_topk(rng, tokens, SPEC.num_layers, SPEC.num_experts, SPEC.top_k)


@dataclass
class Stored:
    segments: list[tuple[int, int, int, str]] = field(default_factory=list)  # start, n, v, key

    @property
    def end(self) -> int:
        start, n, _v, _key = self.segments[-1]
        return start + n

    def expected(self) -> npt.NDArray[Any]:
        """`[T, L, K]` ids as a read returns them: sorted sets, every token routed."""
        parts = [routes(key, n) for _start, n, _v, key in self.segments]
        return np.sort(np.concatenate(parts), axis=-1).astype(np.int16)


class EngineMachine(RuleBasedStateMachine):
    """The rules and invariants; `engine_machine` binds them to a backend."""

    open_store: StoreFactory
    open_catalog: CatalogFactory

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="r3store-machine-"))
        self.rebuilds = 0
        self.engine = self._open("catalog")
        self.settings = NamespaceSettings(max_policy_lag=3, retention=Retention(keep_versions=4))
        self.engine.namespaces.create("ns", SPEC, self.settings)
        self.model: dict[str, Stored] = {}
        self.version = 0

    def _store(self) -> ObjectStore:
        return type(self).open_store(self.dir)

    def _open(self, name: str) -> Engine:
        return Engine(self._store(), type(self).open_catalog(self.dir, name))

    def teardown(self) -> None:
        self.engine.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def _stale(self, version: int) -> bool:
        assert self.settings.max_policy_lag is not None
        return version < self.version - self.settings.max_policy_lag

    @rule(tid=IDS, tokens=st.integers(1, 6), salt=st.integers(0, 2), lag=st.integers(0, 5))
    def put(self, tid: str, tokens: int, salt: int, lag: int) -> None:
        version = max(0, self.version - lag)
        key = f"{tid}/0/{tokens}/{salt}/{version}"
        write = TrajectoryWrite(tid, tokens, topk=routes(key, tokens), policy_version=version)
        stored = self.model.get(tid)
        try:
            [result] = self.engine.put("ns", [write])
        except StalePolicy:
            assert self._stale(version)
            return
        except Conflict:
            assert stored is not None
            assert stored.segments[0][3] != key, "a retry is not a conflict"
            return
        assert not self._stale(version)
        if stored is None:
            assert result.created
            self.model[tid] = Stored([(0, tokens, version, key)])
        else:
            assert not result.created
            assert stored.segments[0][3] == key

    @precondition(lambda self: bool(self.model))
    @rule(data=st.data(), tokens=st.integers(1, 4))
    def append(self, data: st.DataObject, tokens: int) -> None:
        tid = data.draw(st.sampled_from(sorted(self.model)))
        stored = self.model[tid]
        start = stored.end
        key = f"{tid}/{start}/{tokens}/{self.version}"
        write = TrajectoryWrite(
            tid, tokens, topk=routes(key, tokens), start=start, policy_version=self.version
        )
        [result] = self.engine.put("ns", [write])
        assert result.created
        stored.segments.append((start, tokens, self.version, key))

    @rule(step=st.integers(1, 3))
    def new_policy(self, step: int) -> None:
        self.version += step
        assert (
            self.engine.namespaces.set_policy_version("ns", self.version).policy_version
            == self.version
        )

    @rule()
    def maintain(self) -> None:
        report = self.engine.upkeep.maintenance(
            MaintenanceOptions(grace_seconds=0, orphan_seconds=0)
        ).run()
        keep = self.settings.retention.keep_versions
        assert keep is not None
        # older than the last `keep` versions and than the last `keep` holding routes
        held = sorted({v for s in self.model.values() for _, _, v, _ in s.segments})[::-1]
        floor = min(self.version - keep + 1, held[keep - 1]) if len(held) >= keep else -1
        dropped = [t for t, s in self.model.items() if min(v for _, _, v, _ in s.segments) < floor]
        assert report.trajectories_dropped == len(dropped)
        for tid in dropped:
            del self.model[tid]

    @rule()
    def rebuild(self) -> None:
        """The catalog again from the store alone; the engine reopened on it."""
        self.engine.close()
        self.rebuilds += 1
        name = f"rebuilt-{self.rebuilds}"
        report = rebuild_catalog(self._store(), type(self).open_catalog(self.dir, name))
        assert not report.conflicts
        assert report.trajectories == sum(len(s.segments) for s in self.model.values())
        self.engine = self._open(name)
        assert self.engine.namespaces.get("ns").policy_version == self.version

    @invariant()
    def reads_match_the_model(self) -> None:
        ids = [f"t{i}" for i in range(6)]
        batch = self.engine.get_batch("ns", ids, include_stale=True)
        assert sorted(batch.missing) == sorted(set(ids) - set(self.model))
        for tid, item in zip(ids, batch.items, strict=True):
            if tid not in self.model:
                continue
            assert item is not None
            want = self.model[tid]
            assert [(s.start, s.num_tokens, s.policy_version) for s in item.segments] == [
                (start, n, v) for start, n, v, _key in want.segments
            ]
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), want.expected())
        assert self.engine.namespaces.count("ns") == len(self.model)
        served = self.engine.get_batch("ns", sorted(self.model))
        stale = {
            t for t, s in self.model.items() if self._stale(min(v for _, _, v, _ in s.segments))
        }
        assert set(served.stale) == stale


def local_store(root: Path) -> ObjectStore:
    """The default store: a `LocalStore` under `root`."""
    return LocalStore(root / "objects")


def sqlite_catalog(root: Path, name: str) -> Catalog:
    """The default catalog: SQLite in `root/<name>.db`."""
    return Catalog(f"sqlite:///{root / f'{name}.db'}")


def engine_machine(
    open_store: StoreFactory = local_store,
    open_catalog: CatalogFactory = sqlite_catalog,
    max_examples: int = 25,
    steps: int = 15,
) -> type[EngineMachine]:
    """The state machine over the given backend (run its `.TestCase` with pytest or
    unittest); deterministic (`derandomize`), `max_examples` runs of `steps` steps."""
    machine: type[EngineMachine] = type(
        "EngineMachine",
        (EngineMachine,),
        {"open_store": staticmethod(open_store), "open_catalog": staticmethod(open_catalog)},
    )
    machine.TestCase.settings = settings(
        max_examples=max_examples, stateful_step_count=steps, deadline=None, derandomize=True
    )
    return machine
