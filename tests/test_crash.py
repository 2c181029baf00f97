"""SIGKILL a writing process at random moments: nothing acknowledged is lost, nothing is
half-visible."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from crash_child import UNIT
from helpers import SPEC, expected_ids, make_write, run_and_kill
from r3store.engine import Engine
from r3store.engine.rebuild import rebuild_catalog
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore, ObjectStore
from r3store.testing.seaweedfs import SeaweedFS

HERE = Path(__file__).parent


def acked_before_kill(args: list[str], rng: random.Random) -> set[str]:
    output = run_and_kill(HERE / "crash_child.py", args, rng.uniform(0.3, 2.0))
    return {line.split()[1] for line in output.splitlines() if line.startswith("ACK ")}


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["local", "s3"])
def test_sigkill_loses_no_acknowledged_write(
    backend: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    rng = random.Random(1234)
    extra: list[str] = []

    def open_store() -> ObjectStore:
        return LocalStore(tmp_path / "objects")

    if backend == "s3":
        seaweed: SeaweedFS = request.getfixturevalue("seaweed")
        first = seaweed.new_store()
        bucket, prefix = first.bucket, first.config.prefix
        extra = [
            seaweed.endpoint_url,
            bucket,
            prefix,
            seaweed.access_key_id,
            seaweed.secret_access_key,
        ]

        def open_store() -> ObjectStore:
            return seaweed.new_store(prefix)

    acked: set[str] = set()
    for attempt in range(4):
        acked |= acked_before_kill([str(tmp_path), str(attempt * 100_000), *extra], rng)
        catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
        with Engine(open_store(), catalog) as engine:
            check_units(engine, catalog, acked)
    assert len(acked) > 10, "the child acknowledged writes before it was killed"
    # the shards alone hold every acknowledged write too
    store = open_store()
    rebuilt = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    rebuild_catalog(store, rebuilt)
    with Engine(store, rebuilt) as engine:
        check_units(engine, rebuilt, acked)


def check_units(engine: Engine, catalog: Catalog, acked: set[str]) -> None:
    visible: dict[str, int] = {}
    for entry in catalog.segments.by_versions("ns", 0, 0):
        unit = entry.trajectory_id.split("-")[0]
        visible[unit] = visible.get(unit, 0) + 1
    half = {u: n for u, n in visible.items() if n != UNIT}
    assert not half, f"half-visible units: {half}"
    assert acked <= set(visible), f"lost: {sorted(acked - set(visible))[:5]}"
    ids = [f"{u}-{i}" for u in sorted(acked) for i in range(UNIT)]
    batch = engine.get_batch("ns", ids)
    assert batch.missing == []
    for tid, item in zip(ids, batch.items, strict=True):
        assert item is not None
        assert np.array_equal(item.routes.to_topk(), expected_ids(make_write(tid), SPEC))
