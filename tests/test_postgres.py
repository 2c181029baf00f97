"""The catalog on a real PostgreSQL server: the engine, and two server processes sharing
one bucket and one database."""

from __future__ import annotations

import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import SPEC, expected_ids, make_write
from http_helpers import KEEP_ONE_VERSION, KEYS, replicas
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.storage.catalog import Catalog
from r3store.testing.postgres import Postgres
from r3store.testing.seaweedfs import SeaweedFS

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


@pytest.fixture
def pg_url(postgres_server: Postgres) -> str:
    return postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")


def test_engine_on_postgres(pg_url: str, seaweed: SeaweedFS) -> None:
    store = seaweed.new_store()
    with Engine(store, Catalog(pg_url)) as engine:
        engine.namespaces.create("ns", SPEC)
        writes = {
            f"t{i}": make_write(f"t{i}", group_id=f"g{i % 3}", policy_version=i % 2)
            for i in range(24)
        }
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda w: engine.put("ns", [w]), writes.values()))
        batch = engine.get_batch("ns", list(writes))
        assert batch.missing == []
        for tid, item in zip(writes, batch.items, strict=True):
            assert np.array_equal(item.routes.to_topk(), expected_ids(writes[tid]))
        taken = engine.sample("ns", 5).ids
        assert len(set(taken)) == 5
        assert set(taken) <= set(writes)
    behind = Catalog(pg_url)  # behind the engine's back
    try:
        assert len(behind.segments.by_group("ns", "g1")) == 8
    finally:
        behind.close()


def test_two_servers_share_one_bucket_and_database(
    tmp_path: Path, seaweed: SeaweedFS, pg_url: str
) -> None:
    with (
        replicas(tmp_path, seaweed, pg_url) as (a, b),
        httpx.Client(headers=ADMIN, timeout=60) as http,
    ):
        assert http.post(f"{a.url}/v1/namespaces", json=KEEP_ONE_VERSION).status_code == 201
        old = [make_write(f"old{i}", policy_version=0) for i in range(6)]
        live = [make_write(f"live{i}", policy_version=1) for i in range(4)]
        for server, writes in ((a, old[:3] + live[:2]), (b, old[3:] + live[2:])):
            r = http.post(
                f"{server.url}/v1/namespaces/ns/trajectories",
                content=encode_writes(writes),
                headers={"Content-Type": CONTENT_TYPE},
            )
            assert r.status_code == 200, r.text
        # writes through one are read through the other
        ids = [w.trajectory_id for w in old + live]
        for server in (a, b):
            got = decode_batch(
                http.post(f"{server.url}/v1/namespaces/ns/routes/batch", json={"ids": ids}).content
            )[1]
            assert got.missing == []
        assert (
            http.put(
                f"{b.url}/v1/namespaces/ns/policy-version", json={"policy_version": 1}
            ).status_code
            == 200
        )
    # retention and compaction on two replicas at once delete nothing live
    engines = [Engine(seaweed.new_store(a.prefix), Catalog(pg_url)) for _ in range(2)]
    try:
        passes = [e.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)) for e in engines]
        threads = [threading.Thread(target=m.run) for m in passes for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for engine in engines:
            batch = engine.get_batch("ns", [w.trajectory_id for w in live + old])
            assert batch.missing == [w.trajectory_id for w in old]
            for w, item in zip(live, batch.items, strict=False):
                assert np.array_equal(item.routes.to_topk(), expected_ids(w))
    finally:
        for engine in engines:
            engine.close()
