"""SIGKILL in the middle of compaction: nothing live is lost, nothing is half-visible."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from helpers import SPEC, assert_reads_back, make_write, run_and_kill
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.storage.keys import SHARD_PREFIX
from r3store.storage.store import LocalStore

HERE = Path(__file__).parent


def open_catalog(data: Path) -> Catalog:
    return Catalog(f"sqlite:///{data / 'catalog.db'}")


def open_engine(data: Path) -> Engine:
    return Engine(LocalStore(data / "objects"), open_catalog(data))


def check(engine: Engine, data: Path, live: dict[str, TrajectoryWrite]) -> None:
    assert_reads_back(engine, live)
    counts: dict[str, int] = {}
    catalog = open_catalog(data)  # behind the engine's back
    for entry in catalog.segments.by_versions("ns", 0, 1000):
        counts[entry.trajectory_id] = counts.get(entry.trajectory_id, 0) + 1
    catalog.close()
    assert all(n == 1 for n in counts.values()), "a trajectory is in the catalog once"


@pytest.mark.slow
def test_sigkill_during_compaction(tmp_path: Path) -> None:
    rng = random.Random(7)
    live: dict[str, TrajectoryWrite] = {}
    for round_ in range(3):
        with open_engine(tmp_path) as engine:
            if round_ == 0:
                engine.namespaces.create(
                    "ns", SPEC, NamespaceSettings(retention=Retention(keep_versions=1))
                )
            version = engine.namespaces.get("ns").policy_version
            for shard in range(12):  # 12 shards, each three-quarters stale after the bump
                writes = [
                    make_write(f"r{round_}-s{shard}-{i}", policy_version=version) for i in range(3)
                ]
                keep = make_write(f"r{round_}-s{shard}-live", policy_version=100)
                engine.put("ns", [*writes, keep])
                live[keep.trajectory_id] = keep
            engine.namespaces.set_policy_version("ns", version + 1)
        run_and_kill(HERE / "compaction_child.py", [str(tmp_path)], rng.uniform(0.05, 0.6))
        with open_engine(tmp_path) as engine:
            check(engine, tmp_path, live)
    with open_engine(tmp_path) as engine:
        engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0)).run()
        engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0, orphan_seconds=0)).run()
        check(engine, tmp_path, live)
    catalog = open_catalog(tmp_path)
    known = catalog.shards.all_keys()
    catalog.close()
    shards = {o.key for o in LocalStore(tmp_path / "objects").list(SHARD_PREFIX)}
    assert shards == known, "no orphans left"
