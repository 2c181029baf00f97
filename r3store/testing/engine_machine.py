"""The engine against a plain model of what it should hold (a hypothesis state machine):
puts, retries, conflicts, appended turns, policy versions and the staleness window,
retention with compaction and collection, and catalog rebuilds from the store alone;
and consumption: leases (taken FIFO, uniformly or by name; committed, released,
renewed, expired by the machine's clock), plain samples, step checkpoints and resume
(undoing what was committed after the checkpoint, fencing the earlier run's leases).

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
import random
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.engine.rebuild import rebuild_catalog
from r3store.errors import (
    Conflict,
    Fenced,
    LeaseClosed,
    LeaseCommitted,
    LeaseExpired,
    R3StoreError,
    StalePolicy,
)
from r3store.logic.sampling import Candidate, Strategy, choose
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
    created: float = 0.0  # when first stored (FIFO order: oldest first, then by id)
    born: int = 0  # which storing of its id this is (one dropped and put again is another)
    sampled: int = 0  # times sampled: committed leases that hold it

    @property
    def end(self) -> int:
        start, n, _v, _key = self.segments[-1]
        return start + n

    def expected(self) -> npt.NDArray[Any]:
        """`[T, L, K]` ids as a read returns them: sorted sets, every token routed."""
        parts = [routes(key, n) for _start, n, _v, key in self.segments]
        return np.sort(np.concatenate(parts), axis=-1).astype(np.int16)


@dataclass
class Held:
    """A lease as the model has it."""

    ids: tuple[str, ...]
    epoch: int
    expires: float
    state: str = "open"  # open, committed, released, fenced, undone
    seq: int | None = None
    token: str | None = None  # what it was committed with


@dataclass(frozen=True)
class Point:
    """A checkpoint as the model has it, and the sampling counts it implies."""

    consumed: int
    epoch: int
    version: int
    sampled: dict[str, tuple[int, int]]  # id -> (born, times sampled) then


class EngineMachine(RuleBasedStateMachine):
    """The rules and invariants; `engine_machine` binds them to a backend."""

    open_store: StoreFactory
    open_catalog: CatalogFactory

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="r3store-machine-"))
        self.rebuilds = 0
        self.now = float(int(time.time()))  # the engine's clock: moved on by `advance`
        self.engine = self._open("catalog")
        self.settings = NamespaceSettings(
            max_policy_lag=3,
            max_times_sampled=2,
            retention=Retention(keep_versions=4, keep_checkpoints=2),
        )
        self.engine.namespaces.create("ns", SPEC, self.settings)
        self.model: dict[str, Stored] = {}
        self.version = 0
        self.births = 0
        self.leases: dict[str, Held] = {}  # by lease id; samples as `sample-<n>`
        self.consumed = 0  # the namespace's consumption number
        self.epoch = 0
        self.points: dict[int, Point] = {}  # the kept checkpoints, by step

    def _store(self) -> ObjectStore:
        return type(self).open_store(self.dir)

    def _open(self, name: str) -> Engine:
        self.catalog = type(self).open_catalog(self.dir, name)
        return Engine(self._store(), self.catalog, clock=self.clock)

    def clock(self) -> float:
        return self.now

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
            self.births += 1
            self.model[tid] = Stored([(0, tokens, version, key)], self.now, self.births)
        else:
            assert not result.created
            assert stored.segments[0][3] == key

    @initialize(tids=st.lists(IDS, max_size=3, unique=True))
    def stored(self, tids: list[str]) -> None:
        """A few trajectories to begin with (something for leases to take)."""
        for tid in tids:
            self.put(tid, 2, 0, 0)

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
            MaintenanceOptions(grace_seconds=0, orphan_seconds=0, clock=self.clock)
        ).run()
        keep = self.settings.retention.keep_versions
        assert keep is not None
        # older than the last `keep` versions and than the last `keep` holding routes
        held = sorted({v for s in self.model.values() for _, _, v, _ in s.segments})[::-1]
        floor = min(self.version - keep + 1, held[keep - 1]) if len(held) >= keep else -1
        over = [t for t, s in self.model.items() if min(v for _, _, v, _ in s.segments) < floor]
        protected = self._protected()  # held by a lease, or a kept checkpoint's to hand out
        dropped = [t for t in over if t not in protected]
        assert report.trajectories_dropped == len(dropped)
        assert report.trajectories_kept == len(over) - len(dropped)
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
        # the store holds no consumption: no leases, checkpoints or counts, epoch 0
        for stored in self.model.values():
            stored.sampled = 0
        self.leases.clear()
        self.points.clear()
        self.consumed = self.epoch = 0

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

    # consumption: leases, samples, step checkpoints and resume

    def _holds(self, held: Held) -> bool:
        return held.state == "open" and held.expires > self.now

    def _held(self) -> set[str]:
        return {t for h in self.leases.values() if self._holds(h) for t in h.ids}

    def _protected(self) -> set[str]:
        """What retention keeps: held by an open lease, or committed after the oldest
        kept checkpoint, still (a resume to it hands them out again) or undone by a
        resume since (the resumed run takes them again)."""
        found = self._held()
        if self.points:
            oldest = min(p.consumed for p in self.points.values())
            for h in self.leases.values():
                if h.state in ("committed", "undone") and h.seq is not None and h.seq > oldest:
                    found.update(h.ids)
        return found

    def _free(self) -> list[Candidate]:
        """What a lease may take, oldest first: within the window, sampled under
        max_times_sampled, held by no open lease."""
        held, cap = self._held(), self.settings.max_times_sampled
        assert cap is not None
        free = [
            Candidate(t, None, s.created)
            for t, s in self.model.items()
            if t not in held
            and s.sampled < cap
            and not self._stale(min(v for _, _, v, _ in s.segments))
        ]
        return sorted(free, key=lambda c: (c.created_at, c.trajectory_id))

    def _consume(self, held: Held) -> None:
        self.consumed += 1
        held.state, held.seq = "committed", self.consumed
        for tid in held.ids:
            self.model[tid].sampled += 1

    def _refusal(self, held: Held, action: str, token: str | None) -> type[Exception] | None:
        if held.state == "committed":
            retry = action == "commit" and token is not None and token == held.token
            return None if retry else LeaseCommitted
        if held.state in ("fenced", "undone") or held.epoch != self.epoch:
            return Fenced
        if held.state == "released":
            return LeaseClosed
        return LeaseExpired if self.now >= held.expires else None

    def _unchanged(self, step: int) -> bool:
        """Nothing consumed since the checkpoint at `step` (or resumed to it since)."""
        return self.points[step].consumed == self.consumed

    @rule(
        how=st.sampled_from(["fifo", "uniform", "named"]),
        n=st.integers(1, 3),
        seed=st.integers(0, 3),
        seconds=st.sampled_from([5.0, 30.0]),
        old_epoch=st.booleans(),
        data=st.data(),
    )
    def lease(
        self, how: str, n: int, seed: int, seconds: float, old_epoch: bool, data: st.DataObject
    ) -> None:
        free = self._free()
        epoch = self.epoch - 1 if old_epoch and self.epoch else self.epoch
        names = None
        if how == "named":
            names = data.draw(st.lists(IDS, min_size=1, max_size=3, unique=True))
            want = names
        elif how == "fifo":
            want = [c.trajectory_id for c in free[:n]]
        else:
            want = choose(free, n, Strategy.UNIFORM, rng=random.Random(seed))
        strategy = Strategy.FIFO if how == "fifo" else Strategy.UNIFORM
        try:
            lease = self.engine.consumption.lease(
                "ns",
                n=None if names else n,
                trajectory_ids=names,
                strategy=strategy,
                seed=seed,
                seconds=seconds,
                epoch=epoch,
            )
        except Fenced:
            assert epoch != self.epoch
            return
        except Conflict:
            assert names is not None
            assert not set(names) <= {c.trajectory_id for c in free}
            return
        assert epoch == self.epoch
        assert list(lease.trajectory_ids) == want
        assert (lease.epoch, lease.expires_at) == (self.epoch, self.now + seconds)
        self.leases[lease.lease_id] = Held(tuple(want), self.epoch, self.now + seconds)

    @precondition(lambda self: any(not k.startswith("sample") for k in self.leases))
    @rule(
        data=st.data(),
        action=st.sampled_from(["commit", "commit", "release", "renew"]),
        token=st.sampled_from([None, "same", "new"]),
        zombie=st.booleans(),
    )
    def close(self, data: st.DataObject, action: str, token: str | None, zombie: bool) -> None:
        """Commit, release or renew a lease: an open one, or one closed, expired or of
        the run before a resume (`zombie`: such a one if there is)."""
        keys = sorted(k for k in self.leases if not k.startswith("sample"))
        old = [k for k in keys if self.leases[k].epoch < self.epoch]
        key = data.draw(st.sampled_from(old if zombie and old else keys))
        held = self.leases[key]
        sent = held.token if token == "same" else secrets.token_hex(16) if token else None
        why = self._refusal(held, action, sent)
        consumption = self.engine.consumption
        refused: type[Exception] | None = None
        try:
            if action == "commit":
                lease = consumption.commit("ns", key, sent)
            elif action == "release":
                lease = consumption.release("ns", key)
            else:
                lease = consumption.renew("ns", key, 30.0)
        except R3StoreError as exc:
            refused = type(exc)
        assert refused is why, (action, held, why, refused)
        if refused is not None:
            return
        if action == "commit" and held.state == "committed":  # a retry: as it was
            assert lease.seq == held.seq
        elif action == "commit":
            self._consume(held)
            held.token = sent
            assert lease.seq == self.consumed
        elif action == "release":
            held.state = "released"
        else:
            held.expires = self.now + 30.0
            assert lease.expires_at == held.expires
        assert lease.trajectory_ids == held.ids

    @rule(seconds=st.sampled_from([1.0, 5.0, 30.0]))
    def advance(self, seconds: float) -> None:
        """Time passes: leases expire (their trajectories go back uncounted)."""
        self.now += seconds

    @rule(n=st.integers(1, 3))
    def sample(self, n: int) -> None:
        want = [c.trajectory_id for c in self._free()[:n]]
        batch = self.engine.sample("ns", n)
        assert (batch.ids, batch.missing) == (want, [])
        for tid, item in zip(want, batch.items, strict=True):
            assert item is not None
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), self.model[tid].expected())
        if want:  # a lease committed as taken
            held = Held(tuple(want), self.epoch, self.now)
            self._consume(held)
            self.leases[f"sample-{len(self.leases)}"] = held

    @rule(delta=st.integers(-1, 2), old_epoch=st.booleans())
    def checkpoint(self, delta: int, old_epoch: bool) -> None:
        newest = max(self.points, default=None)
        step = max(0, (0 if newest is None else newest) + delta)
        epoch = self.epoch - 1 if old_epoch and self.epoch else self.epoch
        again = newest is not None and newest >= step
        try:
            made = self.engine.consumption.checkpoint("ns", step, epoch=epoch)
        except Fenced:
            assert epoch != self.epoch
            return
        except Conflict:
            assert again
            assert not (newest == step and self._unchanged(step))
            return
        assert epoch == self.epoch
        if again:  # the same step, nothing consumed since: the same checkpoint
            assert newest == step
            assert self._unchanged(step)
        else:
            sampled = {t: (s.born, s.sampled) for t, s in self.model.items()}
            self.points[step] = Point(self.consumed, self.epoch, self.version, sampled)
        point = self.points[step]
        assert (made.step, made.consumed, made.epoch, made.policy_version) == (
            step,
            point.consumed,
            point.epoch,
            point.version,
        )
        keep = self.settings.retention.keep_checkpoints
        assert keep is not None
        for old in sorted(self.points)[:-keep]:
            del self.points[old]

    @precondition(lambda self: bool(self.points))
    @rule(data=st.data())
    def resume(self, data: st.DataObject) -> None:
        step = data.draw(st.sampled_from(sorted(self.points)))
        point = self.points[step]
        undone = [
            h
            for h in self.leases.values()
            if h.state == "committed" and h.seq is not None and h.seq > point.consumed
        ]
        fenced = [h for h in self.leases.values() if self._holds(h)]
        later = [s for s in sorted(self.points) if s > step]
        done = self.engine.consumption.resume("ns", step)
        assert (done.epoch, done.policy_version, done.checkpoints_dropped) == (
            self.epoch + 1,
            point.version,
            later,
        )
        assert (done.leases_undone, done.samplings_undone, done.leases_fenced) == (
            len(undone),
            sum(len(h.ids) for h in undone),
            len(fenced),
        )
        for h in undone:
            h.state = "undone"
            for tid in h.ids:
                self.model[tid].sampled -= 1
        for h in fenced:
            h.state = "fenced"
        for s in later:
            del self.points[s]
        self.epoch += 1
        self.version, self.consumed = point.version, point.consumed
        # the consumption the checkpoint recorded: its counts, none for ids stored since
        for tid, stored in self.model.items():
            born, count = point.sampled.get(tid, (-1, 0))
            assert stored.sampled == (count if born == stored.born else 0), tid

    @invariant()
    def consumption_matches_the_model(self) -> None:
        found = self.catalog.segments.lookup("ns", sorted(self.model))
        for tid, stored in self.model.items():
            first = found[tid][0]
            assert (first.times_sampled, first.created_at) == (stored.sampled, stored.created)
        consumption = self.engine.consumption
        opened = consumption.open_leases("ns")
        assert {lease.lease_id: lease.trajectory_ids for lease in opened} == {
            k: h.ids for k, h in self.leases.items() if self._holds(h)
        }
        held = [t for lease in opened for t in lease.trajectory_ids]
        assert len(held) == len(set(held)), "a trajectory held by two open leases"
        assert self.catalog.leases.epoch("ns") == (self.epoch, self.consumed)
        assert [
            (c.step, c.consumed, c.epoch, c.policy_version) for c in consumption.checkpoints("ns")
        ] == [(s, p.consumed, p.epoch, p.version) for s, p in sorted(self.points.items())]
        assert consumption.protected("ns") == self._protected()


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
