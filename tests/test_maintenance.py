"""Retention, compaction and garbage collection, on the local store and real S3."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from helpers import SPEC, MakeEngine, assert_reads_back, make_write
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.errors import StoreError
from r3store.policy import NamespaceSettings, Retention
from r3store.storage.keys import SHARD_PREFIX
from r3store.storage.store import LocalStore, ObjectStore


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now


def settings(**retention: object) -> NamespaceSettings:
    return NamespaceSettings(retention=Retention(**retention))  # type: ignore[arg-type]


def test_retention_by_versions(store: ObjectStore, make_engine: MakeEngine) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, settings(keep_versions=2))
    for v in range(4):
        engine.put("ns", [make_write(f"v{v}-{i}", policy_version=v) for i in range(2)])
    engine.namespaces.set_policy_version("ns", 3)
    report = engine.upkeep.maintenance().run()
    assert report.trajectories_dropped == 4
    kept = engine.get_batch("ns", [f"v{v}-{i}" for v in range(4) for i in range(2)])
    assert kept.missing == ["v0-0", "v0-1", "v1-0", "v1-1"]


def test_retention_by_time_to_live(tmp_path: Path) -> None:
    from r3store.storage.catalog import Catalog

    clock = Clock()
    engine = Engine(
        LocalStore(tmp_path / "o"), Catalog(f"sqlite:///{tmp_path / 'c.db'}"), clock=clock
    )
    engine.namespaces.create("ns", SPEC, settings(ttl_seconds=3600))
    engine.put("ns", [make_write("old")])
    maintenance = engine.upkeep.maintenance(MaintenanceOptions(clock=clock))
    assert maintenance.run().trajectories_dropped == 0
    clock.now += 1800
    engine.put("ns", [make_write("young")])
    clock.now += 2000  # "old" is now 3800 s old, "young" about 2000 s
    assert maintenance.run().trajectories_dropped == 1
    assert engine.get_batch("ns", ["old", "young"]).missing == ["old"]
    engine.close()


def test_retention_by_consumption(store: ObjectStore, make_engine: MakeEngine) -> None:
    engine = make_engine(store)
    custom = NamespaceSettings(max_times_sampled=1, retention=Retention(evict_after_sampled=True))
    engine.namespaces.create("ns", SPEC, custom)
    engine.put("ns", [make_write(f"c{i}") for i in range(4)])
    assert engine.sample("ns", 3).ids == ["c0", "c1", "c2"]
    assert engine.upkeep.maintenance().run().trajectories_dropped == 3
    assert engine.get_batch("ns", ["c0", "c3"]).missing == ["c0"]


def test_compaction_keeps_live_trajectories_identical(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, settings(keep_versions=1))
    old = {f"o{i}": make_write(f"o{i}", policy_version=0) for i in range(6)}
    new = {f"n{i}": make_write(f"n{i}", policy_version=1) for i in range(2)}
    engine.put("ns", list(old.values()) + list(new.values()))  # one shard, mostly old
    [before] = [o.key for o in store.list(SHARD_PREFIX)]
    engine.namespaces.set_policy_version("ns", 1)
    clock = Clock()
    maintenance = engine.upkeep.maintenance(MaintenanceOptions(clock=clock, grace_seconds=60))
    report = maintenance.run()
    assert report.trajectories_dropped == 6
    assert report.shards_compacted == 1
    assert_reads_back(engine, new)
    assert {o.key for o in store.list(SHARD_PREFIX)} > {before}, "old kept during the grace"
    assert report.objects_deleted == 0
    clock.now += 61
    report = maintenance.run()
    assert report.objects_deleted == 1
    keys = [o.key for o in store.list(SHARD_PREFIX)]
    assert before not in keys
    assert len(keys) == 1
    assert_reads_back(engine, new)
    assert report.dead_bytes < report.live_bytes


def test_failed_compaction_changes_nothing(tmp_path: Path) -> None:
    from r3store.storage.catalog import Catalog

    catalog = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    engine = Engine(LocalStore(tmp_path / "o"), catalog)
    engine.namespaces.create("ns", SPEC, settings(keep_versions=1))
    writes = {f"w{i}": make_write(f"w{i}", policy_version=i // 3) for i in range(4)}
    engine.put("ns", list(writes.values()))
    engine.namespaces.set_policy_version("ns", 1)

    def crash(*_args: object) -> int:
        raise StoreError("the catalog went away mid-compaction")

    catalog.shards.replace = crash  # type: ignore[method-assign]
    report = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0)).run()
    assert report.shards_compacted == 0
    assert_reads_back(engine, {"w3": writes["w3"]})
    # the new shard written before the failure is an orphan: collected, nothing else is
    assert len(list(LocalStore(tmp_path / "o").list(SHARD_PREFIX))) == 1
    assert_reads_back(engine, {"w3": writes["w3"]})
    engine.close()


def test_orphans_older_than_the_grace_are_collected(
    tmp_path: Path, make_engine: MakeEngine
) -> None:
    store = LocalStore(tmp_path / "o")
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    engine.put("ns", [make_write("kept")])
    catalog = make_engine.catalog()
    past = time.time() - 7200
    # uploads this catalog planned and never committed (a crash between put and commit)
    for name, when in (("0000000000001-old", past), ("9999999999999-new", time.time())):
        catalog.ledger.plan_upload(f"{SHARD_PREFIX}ns/{name}.parquet", "ns", "ingest", when)
        store.put(f"{SHARD_PREFIX}ns/{name}.parquet", b"an upload never committed")
    # an object no plan of this catalog names: another catalog's, never deleted
    store.put(f"{SHARD_PREFIX}ns/0000000000002-foreign.parquet", b"not ours")
    for name in ("0000000000001-old", "0000000000002-foreign"):
        path = tmp_path / "o" / SHARD_PREFIX / "ns" / f"{name}.parquet"
        os.utime(path, (past, past))
    report = engine.upkeep.maintenance(MaintenanceOptions(orphan_seconds=3600)).run()
    assert report.orphans_deleted == 1
    assert report.unknown_objects == 1
    names = sorted(p.name for p in (tmp_path / "o" / SHARD_PREFIX / "ns").iterdir())
    assert "0000000000001-old.parquet" not in names
    assert "9999999999999-new.parquet" in names
    assert "0000000000002-foreign.parquet" in names
    assert [p.key for p in catalog.ledger.pending_uploads()] == [
        f"{SHARD_PREFIX}ns/9999999999999-new.parquet"
    ]
    assert_reads_back(engine, {"kept": make_write("kept")})


@pytest.mark.parametrize("rounds", [2])
def test_retention_on_two_engines_at_once_deletes_nothing_live(tmp_path: Path, rounds: int) -> None:
    from r3store.storage.catalog import Catalog

    store = LocalStore(tmp_path / "o")
    url = f"sqlite:///{tmp_path / 'c.db'}"
    a, b = Engine(store, Catalog(url)), Engine(LocalStore(tmp_path / "o"), Catalog(url))
    try:
        a.namespaces.create("ns", SPEC, settings(keep_versions=1))
        live = {f"l{i}": make_write(f"l{i}", policy_version=1) for i in range(3)}
        a.put("ns", [make_write(f"d{i}", policy_version=0) for i in range(5)] + list(live.values()))
        a.namespaces.set_policy_version("ns", 1)
        import threading

        runs = [e.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)) for e in (a, b)]
        threads = [threading.Thread(target=m.run) for m in runs for _ in range(rounds)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert_reads_back(b, live)
        assert_reads_back(a, live)
    finally:
        a.close()
        b.close()


def test_rebuild_does_not_bring_back_what_retention_dropped(
    store: ObjectStore, make_engine: MakeEngine, tmp_path: Path
) -> None:
    from r3store.engine.rebuild import rebuild_catalog
    from r3store.storage.catalog import Catalog

    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, settings(keep_versions=1))
    # one shard, mostly live: retention drops a row that compaction leaves in place
    writes = {f"k{i}": make_write(f"k{i}", policy_version=1) for i in range(4)}
    engine.put("ns", [make_write("gone", policy_version=0), *writes.values()])
    engine.namespaces.set_policy_version("ns", 1)
    report = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
    assert report.trajectories_dropped == 1
    assert report.shards_compacted == 0, "the shard is mostly live and stays"
    fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuilt = rebuild_catalog(store, fresh)
    assert rebuilt.dropped == 1
    assert rebuilt.trajectories == 4
    assert fresh.segments.lookup("ns", ["gone"]) == {}
    fresh.close()
    tombstones = [o.key for o in store.list("tombstones/")]
    assert len(tombstones) == 1
    # once the shard holding the dropped segment is compacted away, the tombstone goes too
    engine.namespaces.update_settings("ns", settings(keep_versions=1))
    engine.namespaces.set_policy_version("ns", 2)  # now every row is stale: the shard empties
    engine.put("ns", [make_write("new", policy_version=2)])
    first = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
    assert first.trajectories_dropped == 4
    second = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
    assert first.tombstones_deleted + second.tombstones_deleted >= 1
    remaining = {o.key for o in store.list("tombstones/")}
    assert tombstones[0] not in remaining


def test_a_preview_changes_nothing_and_a_pass_logs_what_it_deletes(
    tmp_path: Path, make_engine: MakeEngine, caplog: pytest.LogCaptureFixture
) -> None:
    import logging

    store = LocalStore(tmp_path / "o")
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, settings(keep_versions=1))
    engine.put("ns", [make_write(f"d{i}", policy_version=0) for i in range(3)])
    engine.put("ns", [make_write("live", policy_version=1)])
    engine.namespaces.set_policy_version("ns", 1)
    objects = sorted(info.key for info in store.list())
    maintenance = engine.upkeep.maintenance(
        MaintenanceOptions(grace_seconds=0, orphan_seconds=0, cold_seconds=None)
    )
    preview = maintenance.preview()
    assert preview.retention == {"ns": ["d0", "d1", "d2"]}
    assert sorted(info.key for info in store.list()) == objects
    assert engine.namespaces.count("ns") == 4
    with caplog.at_level(logging.INFO, logger="r3store.engine.maintenance"):
        maintenance.run()  # drops the three, retires their shard and deletes it
    assert maintenance.totals.objects_deleted == 1
    shard = next(
        k
        for k in objects
        if k.startswith(SHARD_PREFIX) and k not in {i.key for i in store.list(SHARD_PREFIX)}
    )
    assert f"deleted {shard}: retired for over the grace" in caplog.text
    after = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0))
    assert [why for _key, why in after.preview().delete] == [
        "no shard or upload that may hold its segments is left"  # the tombstone, next
    ]
    after.run()
    assert after.preview().delete == []
