"""Two maintenance passes interleaved on purpose (one pass's catalog call runs the other
pass first), on the local store and real S3: nothing live is lost, and nothing retention
dropped comes back in a rebuild."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import SPEC, MakeEngine, expected_ids, make_write
from r3store.engine import Engine
from r3store.engine.maintenance import Maintenance, MaintenanceOptions, MaintenanceReport
from r3store.logic import rest
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.storage.store import ObjectStore
from test_rest import SPEC as REST_SPEC
from test_rest import _group_writes

KEEP_ONE = NamespaceSettings(retention=Retention(keep_versions=1))


def _pass(engine: Engine, catalog: Catalog, **options: Any) -> Maintenance:
    """A pass over the engine's store through its own catalog connection, so that its
    calls can be hooked without touching the other pass's."""
    store = engine._store  # the same objects: another replica's view
    defaults = {"grace_seconds": 0, "orphan_seconds": 0, "cold_seconds": 0}
    chosen = MaintenanceOptions(**{**defaults, **options})
    return Maintenance(store, catalog, engine.namespaces.spec, chosen)


def _before(catalog: Catalog, name: str, first: Callable[[], object]) -> list[object]:
    """Make `catalog.<repository>.<method>(...)` (`name`: "repository.method") run
    `first()` once, just before it does its own work."""
    owner, method = name.split(".")
    repository = getattr(catalog, owner)
    real = getattr(repository, method)
    ran: list[object] = []

    def hooked(*args: Any, **kwargs: Any) -> Any:
        if not ran:
            ran.append(first())
        return real(*args, **kwargs)

    setattr(repository, method, hooked)
    return ran


def _retention_inside_rest(
    engine: Engine, x: Maintenance, x_catalog: Catalog
) -> tuple[list[object], MaintenanceReport]:
    """Y, a pass without a rest step, runs just before X (over `x_catalog`) replaces the
    shards its rest step copied; X then settles its rest step alone (retention is Y's).
    What Y reported, and X's report."""
    y = engine.upkeep.maintenance(
        MaintenanceOptions(grace_seconds=0, orphan_seconds=0, cold_seconds=None)
    )
    ran = _before(x_catalog, "shards.replace", y.run)
    report = MaintenanceReport()
    x.settle(report)
    return ran, report


def _exact(engine: Engine, namespace: str, writes: dict[str, Any], ids: bool = False) -> None:
    batch = engine.get_batch(namespace, list(writes))
    assert batch.missing == []
    for tid, item in zip(batch.ids, batch.items, strict=True):
        assert item is not None
        assert item.routes is not None
        want = writes[tid][1] if ids else expected_ids(writes[tid])
        assert np.array_equal(item.routes.to_topk(), want), tid


def _rebuilt(engine: Engine, make_engine: MakeEngine, store: ObjectStore) -> Engine:
    engine.flush()
    fresh = make_engine(store, db="rebuilt.db")
    fresh.upkeep.rebuild()
    return fresh


def test_a_dictionary_collected_while_a_pass_encodes_with_it_is_not_committed(
    store: ObjectStore, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", REST_SPEC, KEEP_ONE)
    old = _group_writes(version=0)
    engine.put("ns", [w for w, _ids in old.values()])
    assert (
        engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run().dictionaries_trained
        == 1
    )  # D1, version 0
    new = _group_writes(version=1)
    engine.put("ns", [w for w, _ids in new.values()])
    engine.namespaces.set_policy_version("ns", 1)  # version 0 is now retention's

    at_rest = [u for u in make_engine.catalog().shards.usage("ns") if u.rest_level is not None]
    # X: a rest pass that finds no dictionary of its own for version 1 and takes D1;
    # just before it commits, Y drops version 0 and collects D1 (no row names it then)
    monkeypatch.setattr(rest, "train", lambda samples: None)
    x_catalog = make_engine.catalog()
    # (version 1's rows in one merge; the shard at rest of version 0 is not small)
    x = _pass(engine, x_catalog, rest_shard_bytes=4 * at_rest[0].live_bytes)
    ran, report = _retention_inside_rest(engine, x, x_catalog)
    assert ran
    assert ran[0].trajectories_dropped == len(old)
    assert report.shards_at_rest == 0, "the commit with a collected dictionary is refused"
    monkeypatch.undo()

    _exact(engine, "ns", new, ids=True)
    engine.upkeep.maintenance(
        MaintenanceOptions(cold_seconds=0, grace_seconds=0, orphan_seconds=0)
    ).run()
    _exact(engine, "ns", new, ids=True)
    rebuilt = _rebuilt(engine, make_engine, store)
    _exact(rebuilt, "ns", new, ids=True)
    assert rebuilt.get_batch("ns", list(old)).missing == list(old)


def _mixed(
    make_engine: MakeEngine, store: ObjectStore
) -> tuple[Engine, list[TrajectoryWrite], dict[str, TrajectoryWrite]]:
    """An engine over `store` with one shard: 8 rows of version 0 (retention's once the
    version moves) and 12 of 1, so that a copy holding all 20 is 60% live: never
    compacted."""
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, KEEP_ONE)
    dropped = [make_write(f"old{i}", policy_version=0) for i in range(8)]
    live = {f"new{i}": make_write(f"new{i}", policy_version=1) for i in range(12)}
    engine.put("ns", [*dropped, *live.values()])
    engine.namespaces.set_policy_version("ns", 1)
    return engine, dropped, live


def _settle_down(engine: Engine) -> None:
    for _ in range(3):
        engine.upkeep.maintenance(
            MaintenanceOptions(cold_seconds=0, grace_seconds=0, orphan_seconds=0)
        ).run()


def _stay_dropped(
    engine: Engine,
    make_engine: MakeEngine,
    store: ObjectStore,
    dropped: list[TrajectoryWrite],
    live: dict[str, TrajectoryWrite],
) -> None:
    """After passes settle: the live rows read back exactly, the dropped ones are gone,
    from the catalog and from a rebuild of the store alike."""
    _settle_down(engine)
    gone = [w.trajectory_id for w in dropped]
    for reading in (engine, _rebuilt(engine, make_engine, store)):
        _exact(reading, "ns", live)
        assert reading.get_batch("ns", gone).missing == gone


def test_rows_retention_drops_while_a_rest_pass_copies_them_stay_dropped(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine, dropped, live = _mixed(make_engine, store)
    # X copies the shard's 20 rows into a new object; before X commits, Y drops 8
    x_catalog = make_engine.catalog()
    x = _pass(engine, x_catalog)
    ran, report = _retention_inside_rest(engine, x, x_catalog)
    assert ran
    assert ran[0].trajectories_dropped == 8
    assert report.shards_at_rest == 0, "rows dropped meanwhile: the switch is refused"
    _stay_dropped(engine, make_engine, store, dropped, live)


def test_rows_a_rest_pass_moved_while_retention_drops_them_stay_dropped(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine, dropped, live = _mixed(make_engine, store)
    # Y writes its tombstone naming the old shard; before Y forgets the rows, X moves
    # all 20 into a new shard and commits
    y_catalog = make_engine.catalog()
    y = _pass(engine, y_catalog, cold_seconds=None)
    x = engine.upkeep.maintenance(
        MaintenanceOptions(grace_seconds=0, orphan_seconds=0, cold_seconds=0)
    )
    moved = MaintenanceReport()
    ran = _before(y_catalog, "leases.drop", lambda: x.settle(moved))
    y.run()
    assert ran
    assert moved.shards_at_rest == 1
    # the moved rows are dropped again, with a tombstone naming them
    _stay_dropped(engine, make_engine, store, dropped, live)


def test_an_orphan_collected_while_its_commit_is_under_way_is_not_committed(
    tmp_path: Path, make_engine: MakeEngine
) -> None:
    from r3store.storage.store import LocalStore

    engine = make_engine(LocalStore(tmp_path / "o"))
    engine.namespaces.create("ns", SPEC)
    catalog = engine._catalog
    # a commit delayed past the orphan age: collection takes the upload first
    sweep = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0))
    _before(catalog, "shards.commit", sweep.run)
    engine.put("ns", [make_write("slow")])  # settled again into a new shard, acknowledged
    _exact(engine, "ns", {"slow": make_write("slow")})
    assert sweep.totals.orphans_deleted == 1
    assert catalog.ledger.pending_uploads() == []


def test_a_dictionary_being_deleted_cannot_be_recorded_or_held_again(
    tmp_path: Path,
) -> None:
    catalog = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    digest, now = b"d" * 16, 1000.0
    assert catalog.ledger.record_dictionary("ns", digest, 1, now)
    assert catalog.ledger.start_dropping_dictionary("ns", digest, now + 1)
    # a pass that trained the same dictionary again, while its object is being deleted
    assert not catalog.ledger.record_dictionary("ns", digest, 1, now + 2)
    assert not catalog.ledger.hold_dictionary("ns", digest, now + 2)
    catalog.ledger.forget_dictionary("ns", digest)
    assert catalog.ledger.record_dictionary("ns", digest, 1, now + 3)  # gone: a new one may come
    assert catalog.ledger.hold_dictionary("ns", digest, now + 4)
    assert not catalog.ledger.start_dropping_dictionary("ns", digest, now + 4)  # held since
    catalog.close()


def test_a_namespace_deletion_that_fails_midway_is_finished_by_maintenance(
    store: ObjectStore, make_engine: MakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    from r3store.errors import StoreError

    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    for i in range(3):
        engine.put("ns", [make_write(f"t{i}")])
    real = store.delete
    calls: list[str] = []

    def fails_second(key: str) -> None:
        calls.append(key)
        if len(calls) == 2:
            raise StoreError("the store went away")
        real(key)

    monkeypatch.setattr(store, "delete", fails_second)
    with pytest.raises(StoreError):
        engine.namespaces.delete("ns")
    monkeypatch.undo()
    assert len(list(store.list("shards/"))) == 2
    report = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0)).run()
    assert report.unknown_objects == 0
    assert list(store.list("shards/")) == []
    assert make_engine.catalog().ledger.pending_uploads() == []


def _counted(settings: NamespaceSettings, engine: Engine) -> dict[str, TrajectoryWrite]:
    """One shard of 20 rows in a namespace of `settings`, every row cold."""
    engine.namespaces.create("ns", SPEC, settings)
    writes = {f"t{i}": make_write(f"t{i}") for i in range(20)}
    engine.put("ns", list(writes.values()))
    return writes


def _rest_pass(engine: Engine, make_engine: MakeEngine) -> tuple[Maintenance, Catalog]:
    catalog = make_engine.catalog()
    return _pass(engine, catalog), catalog


def test_a_lease_committed_while_a_pass_rewrites_its_rows_stays_counted(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine = make_engine(store)
    writes = _counted(NamespaceSettings(max_times_sampled=1), engine)
    x, x_catalog = _rest_pass(engine, make_engine)
    taken: list[str] = []

    def consume() -> None:  # a trainer's step, between the pass's read and its switch
        lease = engine.consumption.lease("ns", n=8)
        engine.consumption.commit("ns", lease.lease_id)
        taken.extend(lease.trajectory_ids)

    ran = _before(x_catalog, "shards.replace", consume)
    report = MaintenanceReport()
    x.settle(report)
    assert ran
    assert len(taken) == 8
    assert report.shards_at_rest == 1, "the switch itself goes through"
    counts = {e.trajectory_id: e.times_sampled for e in _entries(engine, list(writes))}
    assert counts == {tid: int(tid in taken) for tid in writes}
    # sampled max_times_sampled times: never handed out again
    rest = engine.consumption.lease("ns", n=20)
    assert not set(rest.trajectory_ids) & set(taken)
    assert len(rest.trajectory_ids) == 12
    _exact(engine, "ns", writes)


def test_a_resume_while_a_pass_rewrites_its_rows_gives_them_back(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine = make_engine(store)
    writes = _counted(NamespaceSettings(max_times_sampled=1), engine)
    engine.consumption.checkpoint("ns", step=0)
    first = engine.consumption.lease("ns", n=8)
    engine.consumption.commit("ns", first.lease_id)
    x, x_catalog = _rest_pass(engine, make_engine)
    ran = _before(x_catalog, "shards.replace", lambda: engine.consumption.resume("ns", step=0))
    report = MaintenanceReport()
    x.settle(report)
    assert ran
    assert report.shards_at_rest == 1
    assert all(e.times_sampled == 0 for e in _entries(engine, list(writes)))
    again = engine.consumption.lease("ns", n=8)  # as the docs say: available again
    assert again.trajectory_ids == first.trajectory_ids


def _entries(engine: Engine, ids: list[str]) -> list[Any]:
    found = engine._catalog.segments.lookup("ns", ids)
    return [e for segments in found.values() for e in segments]


def test_shards_committed_while_collection_reads_the_catalog_are_not_unknown(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    """Puts that commit between each of collection's reads (the store's listing, the
    uploads pending, the shards committed) are never reported as objects this catalog
    did not write."""
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    engine.put("ns", [make_write("first")])
    sweep_catalog = make_engine.catalog()
    sweep = _pass(engine, sweep_catalog)
    puts = iter(range(100))

    def put() -> None:
        engine.put("ns", [make_write(f"during{next(puts)}")])

    hooks = [
        _before(sweep_catalog, name, put)
        for name in ("ledger.pending_uploads", "shards.all_keys", "ledger.dictionary_keys")
    ]
    report = MaintenanceReport()
    sweep.collect(report)
    assert all(hooks), "each read ran after a put committed"
    assert report.unknown_objects == 0
    assert report.orphans_deleted == 0
    ids = ["first", *(f"during{i}" for i in range(3))]
    _exact(engine, "ns", {tid: make_write(tid) for tid in ids})
