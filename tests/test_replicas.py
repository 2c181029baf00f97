"""Several replicas, one catalog: conflicts settle per upload, identical uploads racing
on two replicas are both acknowledged, and nothing acknowledged is lost."""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import SPEC, expected_ids, make_write
from http_helpers import KEEP_ONE_VERSION, KEYS, ServerProcess, replicas
from r3store.engine import Engine, EngineConfig
from r3store.engine.maintenance import MaintenanceOptions
from r3store.engine.reader import ReaderConfig
from r3store.engine.writer import WriterConfig
from r3store.errors import Conflict
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.records import PutResult, TrajectoryWrite
from r3store.spans import ByteRange
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore, ObjectInfo, ObjectStore
from r3store.testing.postgres import Postgres
from r3store.testing.seaweedfs import SeaweedFS

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


class BeforeShardPut(ObjectStore):
    """A real store that runs `hook` once, just before the first shard is stored: what
    another replica does while this one uploads."""

    def __init__(self, inner: ObjectStore, hook: Callable[[], None]) -> None:
        self.inner = inner
        self.hook: Callable[[], None] | None = hook

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        if key.startswith("shards/") and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        self.inner.put_if_absent(key, data)

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        return self.inner.get(key, byte_range)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self.inner.put(key, data)

    def head(self, key: str) -> ObjectInfo:
        return self.inner.head(key)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        return self.inner.list(prefix)

    def delete(self, key: str) -> None:
        self.inner.delete(key)


@pytest.mark.parametrize("same_content", [False, True])
def test_a_lost_race_fails_only_the_upload_that_conflicts(
    tmp_path: Path, same_content: bool
) -> None:
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    objects = LocalStore(tmp_path / "objects")
    other = Engine(objects, Catalog(url))
    other.namespaces.create("ns", SPEC)
    clash = make_write("x")
    theirs = clash if same_content else TrajectoryWrite("x", 9, topk=make_write("z", tokens=9).topk)
    store = BeforeShardPut(objects, lambda: other.put("ns", [theirs]))
    # units queue for a while, so the three puts share one shard
    mine = Engine(store, Catalog(url), EngineConfig(writer=WriterConfig(commit_interval=0.5)))
    writes = [clash, make_write("y"), make_write("w")]
    outcomes: dict[str, list[PutResult] | Exception] = {}

    def put(write: TrajectoryWrite) -> None:
        try:
            outcomes[write.trajectory_id] = mine.put("ns", [write])
        except Conflict as exc:
            outcomes[write.trajectory_id] = exc

    threads = [threading.Thread(target=put, args=(w,)) for w in writes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        assert store.hook is None  # the other replica did commit first
        for write in writes[1:]:
            result = outcomes[write.trajectory_id]
            assert isinstance(result, list), result
            assert result[0].created
        if same_content:
            result = outcomes["x"]
            assert isinstance(result, list), result
            assert result[0].created is False
        else:
            assert isinstance(outcomes["x"], Conflict)
        batch = mine.get_batch("ns", ["x", "y", "w"])
        assert batch.missing == []
        for write, item in zip([theirs, *writes[1:]], batch.items, strict=True):
            assert np.array_equal(item.routes.to_topk(), expected_ids(write))
        # the shard that lost the race is gone, not left as an orphan
        shards = {info.key for info in objects.list("shards/")}
        assert shards == {u.key for u in Catalog(url).shards.usage()}
    finally:
        mine.close()
        other.close()


@pytest.mark.slow
def test_two_replicas_on_postgres(
    tmp_path: Path, seaweed: SeaweedFS, postgres_server: Postgres
) -> None:
    """Distinct-id writers on both replicas, identical uploads hitting both at the same
    instant, maintenance (retention, compaction, collection) running on both: no
    spurious 409, no acknowledged upload lost."""
    pg_url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    env = {"R3STORE_MAINTENANCE_INTERVAL": "1", "R3STORE_MAINTENANCE_GRACE": "0"}
    statuses: Counter[int] = Counter()
    acked: dict[str, TrajectoryWrite] = {}
    lock = threading.Lock()

    def upload(http: httpx.Client, url: str, writes: list[TrajectoryWrite]) -> httpx.Response:
        r = http.post(
            f"{url}/v1/namespaces/ns/trajectories",
            content=encode_writes(writes),
            headers={"Content-Type": CONTENT_TYPE},
        )
        with lock:
            statuses[r.status_code] += 1
            if r.status_code == 200:
                for w in writes:
                    acked[w.trajectory_id] = w
        return r

    with (
        replicas(tmp_path, seaweed, pg_url, env) as (a, b),
        httpx.Client(headers=ADMIN, timeout=60) as http,
    ):
        assert http.post(f"{a.url}/v1/namespaces", json=KEEP_ONE_VERSION).status_code == 201
        assert http.post(f"{b.url}/v1/namespaces", json=KEEP_ONE_VERSION).status_code == 200
        old = [make_write(f"old{i}", policy_version=0) for i in range(12)]
        assert upload(http, a.url, old[:6]).status_code == 200
        assert upload(http, b.url, old[6:]).status_code == 200
        r = http.put(f"{a.url}/v1/namespaces/ns/policy-version", json={"policy_version": 1})
        assert r.status_code == 200  # the old ones now go: retention, then compaction

        def distinct(server: ServerProcess, name: str) -> None:
            with httpx.Client(headers=ADMIN, timeout=60) as own:
                for i in range(15):
                    upload(own, server.url, [make_write(f"{name}-{i}", policy_version=1)])

        def same_pair(i: int) -> None:
            write = make_write(f"same-{i}", policy_version=1)
            barrier = threading.Barrier(2)
            answers: list[httpx.Response] = []

            def one(server: ServerProcess) -> None:
                with httpx.Client(headers=ADMIN, timeout=60) as own:
                    barrier.wait()
                    answers.append(upload(own, server.url, [write]))

            pair = [threading.Thread(target=one, args=(s,)) for s in (a, b)]
            for t in pair:
                t.start()
            for t in pair:
                t.join(60)
            created = [r.json()["results"][0]["created"] for r in answers if r.status_code == 200]
            assert sorted(created) == [False, True], [r.text for r in answers]

        workers = [
            threading.Thread(target=distinct, args=(a, "a")),
            threading.Thread(target=distinct, args=(b, "b")),
        ]
        for t in workers:
            t.start()
        for i in range(20):
            same_pair(i)
        for t in workers:
            t.join(120)
        assert statuses[409] == 0, statuses
        assert set(statuses) == {200}, statuses
        live = sorted(tid for tid in acked if not tid.startswith("old"))
        assert len(live) == 2 * 15 + 20
        for _ in range(100):  # maintenance runs every second on both replicas
            r = http.post(f"{a.url}/v1/namespaces/ns/routes/batch", json={"ids": ["old0"]})
            if decode_batch(r.content)[1].missing:
                break
            time.sleep(0.2)
        for server in (a, b):
            r = http.post(
                f"{server.url}/v1/namespaces/ns/routes/batch", json={"ids": [*live, "old0"]}
            )
            assert r.status_code == 200, r.text
            batch = decode_batch(r.content)[1]
            assert batch.missing == ["old0"]  # dropped by retention, as configured
            for tid, item in zip(live, batch.items, strict=False):
                assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid]))
    logs = [(tmp_path / d / f"server-{s.port}.log").read_text() for d, s in (("a", a), ("b", b))]
    assert any('"msg": "maintenance"' in log for log in logs)  # it ran, and dropped the old


class BeforeFirstRangedRead(BeforeShardPut):
    """A real store that runs `hook` once, before the first ranged read of a shard."""

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        if byte_range is not None and self.hook is not None:
            hook, self.hook = self.hook, None
            hook()
        return self.inner.get(key, byte_range)


def test_a_read_that_raced_compaction_looks_up_again(tmp_path: Path) -> None:
    """Compaction moves the rows and the old shard's grace runs out between a read's
    catalog lookup and its ranged GET: the read finds the rows in their new shard."""
    from r3store.policy import NamespaceSettings, Retention

    store = BeforeFirstRangedRead(LocalStore(tmp_path / "objects"), lambda: None)
    no_cache = EngineConfig(reader=ReaderConfig(cache_bytes=0))  # every read a ranged GET
    catalog = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
    engine = Engine(store, catalog, no_cache)
    try:
        engine.namespaces.create(
            "ns", SPEC, NamespaceSettings(retention=Retention(keep_versions=1))
        )
        writes = [make_write(f"t{i}", policy_version=int(i % 3 == 0)) for i in range(6)]
        engine.put("ns", writes)
        engine.namespaces.set_policy_version("ns", 1)
        before = {u.key for u in catalog.shards.usage()}
        store.hook = lambda: engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
        kept = [w for w in writes if w.policy_version == 1]
        batch = engine.get_batch("ns", [w.trajectory_id for w in kept])
        assert store.hook is None  # compaction ran in between
        assert {u.key for u in catalog.shards.usage()}.isdisjoint(before)
        assert batch.missing == []
        for write, item in zip(kept, batch.items, strict=True):
            assert np.array_equal(item.routes.to_topk(), expected_ids(write))
    finally:
        engine.close()
