"""Operator mistakes that used to lose shards, tried for real (SeaweedFS, SQLite and
PostgreSQL, server and command-line processes): a second, empty or stale catalog on
the same bucket deletes nothing and is told what is wrong; a second server on one
SQLite catalog is refused; a replica waits for its database; a missing bucket is said."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import sqlite3
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import SPEC, expected_ids, make_write
from http_helpers import KEYS, ServerProcess
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.errors import InvalidConfig, StoreError
from r3store.storage.catalog import Catalog
from r3store.storage.keys import IDENTITY_KEY, SHARD_PREFIX
from r3store.storage.store import S3Store
from r3store.storage.store.base import ObjectInfo
from r3store.testing.postgres import Postgres
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import Client
from r3store_server.settings import load_settings

WRITES = {f"t{i}": make_write(f"t{i}") for i in range(8)}


def _s3_env(seaweed: SeaweedFS, prefix: str, data_dir: Path) -> dict[str, str]:
    return {
        **os.environ,
        "R3STORE_DATA_DIR": str(data_dir),
        "R3STORE_STORE": "s3",
        "R3STORE_S3__ENDPOINT_URL": seaweed.endpoint_url,
        "R3STORE_S3__BUCKET": seaweed.config().bucket,
        "R3STORE_S3__PREFIX": prefix,
        "R3STORE_S3__ACCESS_KEY_ID": seaweed.access_key_id,
        "R3STORE_S3__SECRET_ACCESS_KEY": seaweed.secret_access_key,
    }


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def _exits(server: ServerProcess, seconds: float = 60) -> str:
    """The server's log once it exited by itself (it must, within `seconds`)."""
    try:
        code = server.process.wait(timeout=seconds)
    finally:
        server.kill()
    assert code != 0
    return (Path(server.log.name)).read_text()


def _check(client: Client) -> None:
    batch = client.get_batch("ns", list(WRITES))
    assert batch.missing == []
    for tid, item in zip(batch.ids, batch.items, strict=True):
        assert np.array_equal(item.routes.to_topk(), expected_ids(WRITES[tid]))


def test_a_second_catalog_on_the_same_bucket_deletes_nothing(
    tmp_path: Path, seaweed: SeaweedFS, caplog: pytest.LogCaptureFixture
) -> None:
    (tmp_path / "a").mkdir()
    server = ServerProcess(tmp_path / "a", seaweed)
    prefix = server.prefix
    try:
        with Client(server.url, KEYS["admin"]) as client:
            client.create_namespace("ns", SPEC)
            for tid, write in WRITES.items():  # one shard each
                client.put("ns", [write])
                assert tid
        store = seaweed.new_store(prefix)
        shards = sorted(info.key for info in store.list(SHARD_PREFIX))
        assert len(shards) == len(WRITES)
        identity = json.loads(store.get(IDENTITY_KEY))

        # the CLI run from another directory: no catalog there, none made
        other = tmp_path / "elsewhere"
        other.mkdir()
        env = _s3_env(seaweed, prefix, other)
        done = _cli(env, "stats")
        assert done.returncode == 2
        assert "no catalog at" in done.stderr
        assert "--init" in done.stderr
        assert not (other / "catalog.db").exists()
        # asked to make one anyway, and to collect orphans at once: refused, named
        done = _cli(env, "--init", "maintain", "--orphan-age", "0", "--grace", "0")
        assert done.returncode == 2
        assert f"belongs to catalog {identity['catalog']}" in done.stderr
        assert "rebuild" in done.stderr
        # a server on a fresh data directory (or another deployment on the prefix)
        (tmp_path / "b").mkdir()
        second = ServerProcess(tmp_path / "b", seaweed, prefix=prefix, wait=False)
        log = _exits(second)
        assert f"belongs to catalog {identity['catalog']}" in log

        # the library, unbound, on an empty catalog: collects nothing it did not plan
        fresh = Engine(seaweed.new_store(prefix), Catalog(f"sqlite:///{tmp_path / 'x.db'}"))
        with caplog.at_level(logging.WARNING, logger="r3store.engine.maintenance"):
            report = fresh.upkeep.maintenance(
                MaintenanceOptions(orphan_seconds=0, grace_seconds=0)
            ).run()
        fresh.close()
        assert report.orphans_deleted == 0
        assert report.unknown_objects == len(WRITES)
        assert "did not write are left alone" in caplog.text

        assert sorted(info.key for info in store.list(SHARD_PREFIX)) == shards
        with Client(server.url, KEYS["admin"]) as client:
            _check(client)
        store.close()
    finally:
        server.stop()


def _bound_engine(tmp_path: Path, seaweed: SeaweedFS) -> tuple[Engine, str, str]:
    """A new bound engine on a fresh prefix with a SQLite catalog, namespace `ns` made."""
    prefix = f"t-{uuid.uuid4().hex[:16]}"
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    engine = Engine(seaweed.new_store(prefix), Catalog(url))
    engine.upkeep.bind(create=True)
    engine.namespaces.create("ns", SPEC)
    return engine, prefix, url


def _backup(tmp_path: Path) -> None:
    """The catalog copied as a backup tool would (SQLite's online backup)."""
    live, copy = sqlite3.connect(tmp_path / "catalog.db"), sqlite3.connect(tmp_path / "b.db")
    live.backup(copy)
    live.close()
    copy.close()


def _restore(tmp_path: Path) -> None:
    shutil.copy(tmp_path / "b.db", tmp_path / "catalog.db")
    for suffix in ("-wal", "-shm"):
        (tmp_path / f"catalog.db{suffix}").unlink(missing_ok=True)


def test_a_catalog_restored_from_a_backup_deletes_nothing_newer(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    engine, prefix, url = _bound_engine(tmp_path, seaweed)
    items = list(WRITES.values())
    for write in items[:4]:
        engine.put("ns", [write])
    _backup(tmp_path)
    for write in items[4:]:
        engine.put("ns", [write])
    engine.close()
    _restore(tmp_path)

    restored = Engine(seaweed.new_store(prefix), Catalog(url))
    restored.upkeep.bind(create=False)  # the same catalog, older
    report = restored.upkeep.maintenance(
        MaintenanceOptions(orphan_seconds=0, grace_seconds=0)
    ).run()
    assert report.orphans_deleted == 0
    assert report.unknown_objects == 4  # the shards written after the backup: said, kept
    assert restored.get_batch("ns", list(WRITES)).missing == [w.trajectory_id for w in items[4:]]
    restored.upkeep.rebuild()  # what the warning advises: every trajectory again
    batch = restored.get_batch("ns", list(WRITES))
    assert batch.missing == []
    assert (
        restored.upkeep.maintenance(MaintenanceOptions(orphan_seconds=0)).run().unknown_objects == 0
    )
    restored.close()


def test_an_s3_catalog_never_depends_on_the_working_directory(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in list(os.environ):
        if name.startswith("R3STORE_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("R3STORE_STORE", "s3")
    with pytest.raises(InvalidConfig, match="R3STORE_CATALOG_URL"):
        load_settings()
    monkeypatch.setenv("R3STORE_CATALOG_URL", "sqlite:///relative/catalog.db")
    with pytest.raises(InvalidConfig, match="working directory"):
        load_settings()
    monkeypatch.setenv("R3STORE_CATALOG_URL", f"sqlite:///{tmp_path / 'catalog.db'}")
    assert load_settings().catalog_url
    monkeypatch.delenv("R3STORE_CATALOG_URL")
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path))  # absolute: SQLite there
    assert load_settings().resolved_catalog_url() == f"sqlite:///{tmp_path / 'catalog.db'}"


def test_a_second_server_on_one_sqlite_catalog_is_refused(tmp_path: Path) -> None:
    first = ServerProcess(tmp_path, None)
    try:
        second = ServerProcess(tmp_path, None, wait=False)
        log = _exits(second)
        assert f"another r3store-server (pid {first.process.pid})" in log
        assert "PostgreSQL" in log
        assert httpx.get(f"{first.url}/readyz").status_code == 200
    finally:
        first.stop()
    again = ServerProcess(tmp_path, None)  # the lock goes with its holder
    again.stop()


def _first_answer(server: ServerProcess) -> httpx.Response:
    """`/readyz` as soon as the server listens (it must not exit meanwhile)."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return httpx.get(f"{server.url}/readyz", timeout=5)
        except httpx.TransportError:
            assert server.process.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "never answered"
            time.sleep(0.2)


def test_a_replica_waits_for_its_database_and_says_why(
    tmp_path: Path, postgres_server: Postgres
) -> None:
    name = f"r3_{uuid.uuid4().hex[:12]}"
    url = postgres_server.database(name)
    postgres_server.allow_connections(name, False)  # restarting, as far as it can tell
    server = ServerProcess(tmp_path, None, catalog_url=url, wait=False)
    try:
        try:
            ready = _first_answer(server)
            assert ready.status_code == 503
            assert "starting: the catalog is unavailable" in ready.json()["detail"]
            assert httpx.get(f"{server.url}/healthz").status_code == 200
            api = httpx.get(f"{server.url}/v1/namespaces", headers={"X-API-Key": KEYS["admin"]})
            assert api.status_code == 503
        finally:
            postgres_server.allow_connections(name, True)
        deadline = time.monotonic() + 60
        while httpx.get(f"{server.url}/readyz", timeout=5).status_code != 200:
            assert server.process.poll() is None, "the server exited"
            assert time.monotonic() < deadline, "never ready"
            time.sleep(0.5)
        with Client(server.url, KEYS["admin"]) as client:
            client.create_namespace("ns", SPEC)
            client.put("ns", [WRITES["t0"]])
            assert client.get_batch("ns", ["t0"]).missing == []
    finally:
        server.stop()
    assert "retrying in" in Path(server.log.name).read_text()


def test_a_missing_bucket_is_said_and_not_made(tmp_path: Path, seaweed: SeaweedFS) -> None:
    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    server = ServerProcess(
        tmp_path, seaweed, wait=False, env={"R3STORE_S3__BUCKET": bucket}, prefix="p"
    )
    try:
        ready = _first_answer(server)
        assert ready.status_code == 503
        assert "does not exist" not in ready.json()["detail"]  # no key: says less
        keyed = httpx.get(f"{server.url}/readyz", headers={"X-API-Key": KEYS["reader"]})
        assert "does not exist" in keyed.json()["detail"]
    finally:
        server.stop()
    probe = S3Store(dataclasses.replace(seaweed.config(), bucket=bucket))
    with pytest.raises(StoreError, match="does not exist"):
        probe.ping()
    probe.close()


def test_two_bound_catalogs_never_share_a_store(tmp_path: Path) -> None:
    from r3store.storage.store import LocalStore

    def engine(store: str, db: str) -> Engine:
        return Engine(LocalStore(tmp_path / store), Catalog(f"sqlite:///{tmp_path / db}"))

    a, b = engine("a", "a.db"), engine("b", "b.db")
    ids = a.upkeep.bind(create=True), b.upkeep.bind(create=True)
    a.namespaces.create("ns", SPEC)
    a.put("ns", [WRITES["t0"]])
    a.close()
    b.close()
    crossed = engine("a", "b.db")  # cluster b's catalog on cluster a's prefix
    with pytest.raises(InvalidConfig, match=f"belongs to catalog {ids[0]}.*is catalog {ids[1]}"):
        crossed.upkeep.bind(create=True)
    crossed.close()
    again = engine("a", "a.db")
    assert again.upkeep.bind(create=False) == ids[0]
    assert again.get_batch("ns", ["t0"]).missing == []
    again.close()


def test_a_deployment_made_before_identities_is_bound_in_place(tmp_path: Path) -> None:
    import sqlalchemy as sa

    from r3store.storage.store import LocalStore

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    old = Engine(LocalStore(tmp_path / "objects"), Catalog(url))
    old.namespaces.create("ns", SPEC)
    old.put("ns", [WRITES["t0"]])  # no identity anywhere, as before they existed
    old.close()
    assert not (tmp_path / "objects" / IDENTITY_KEY).exists()
    with sa.create_engine(url).begin() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM catalog_meta")).scalar_one() == 0
    # a fresh, empty catalog on that store is refused; its own catalog is bound
    other = Engine(LocalStore(tmp_path / "objects"), Catalog(f"sqlite:///{tmp_path / 'x.db'}"))
    with pytest.raises(InvalidConfig, match="holds objects but no identity"):
        other.upkeep.bind(create=True)
    other.close()
    engine = Engine(LocalStore(tmp_path / "objects"), Catalog(url))
    bound = engine.upkeep.bind(create=False)
    assert json.loads((tmp_path / "objects" / IDENTITY_KEY).read_bytes())["catalog"] == bound
    assert engine.get_batch("ns", ["t0"]).missing == []
    engine.close()


def test_presigned_urls_name_the_endpoint_trainers_reach() -> None:
    from r3store.storage.store import S3Config

    inside = S3Store(
        S3Config(
            bucket="routes",
            endpoint_url="http://s3.storage.svc:9000",
            access_key_id="id",
            secret_access_key="secret",
        )
    )
    public = S3Store(
        dataclasses.replace(inside.config, public_endpoint_url="https://s3.example.org")
    )
    try:
        assert inside.presign_get("shards/a", 60).startswith("http://s3.storage.svc:9000/routes/")
        assert public.presign_get("shards/a", 60).startswith("https://s3.example.org/routes/")
    finally:
        inside.close()
        public.close()


def test_a_backup_taken_while_an_upload_was_pending_is_refused_until_rebuilt(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    engine, prefix, url = _bound_engine(tmp_path, seaweed)
    catalog = engine._catalog
    real = catalog.shards.commit

    def backup_first(*args: object, **kwargs: object) -> None:
        # the backup sees the upload planned and its object stored, not its commit
        _backup(tmp_path)
        catalog.shards.commit = real  # type: ignore[method-assign]
        real(*args, **kwargs)  # type: ignore[arg-type]

    catalog.shards.commit = backup_first  # type: ignore[method-assign]
    engine.put("ns", [WRITES["t0"]])  # acknowledged
    engine.upkeep.maintenance().run()  # a pass after the backup counts the generation up
    engine.close()
    _restore(tmp_path)

    restored = Engine(seaweed.new_store(prefix), Catalog(url))
    try:
        with pytest.raises(InvalidConfig, match=r"older than .*restored from a backup"):
            restored.upkeep.bind(create=False)
        # a pass anyway (the library, unbound) deletes nothing: the planned upload,
        # committed after the backup, stays
        assert restored._catalog.ledger.pending_uploads() != []
        sweep = restored.upkeep.maintenance(MaintenanceOptions(orphan_seconds=0, grace_seconds=0))
        preview = sweep.preview()
        assert preview.delete == []
        assert preview.behind is not None
        assert "restored from a backup" in preview.behind
        report = sweep.run()
        assert report.orphans_deleted == 0
        assert report.catalog_behind == 1
        assert len(list(seaweed.new_store(prefix).list(SHARD_PREFIX))) == 1
        restored.upkeep.rebuild()
        assert restored.upkeep.bind(create=False)
        assert restored.get_batch("ns", ["t0"]).missing == []
    finally:
        restored.close()


def test_replicas_binding_one_new_store_at_once_agree(
    postgres_server: Postgres, seaweed: SeaweedFS
) -> None:
    import threading

    url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    prefix = f"t-{uuid.uuid4().hex[:16]}"
    engines = [Engine(seaweed.new_store(prefix), Catalog(url)) for _ in range(4)]
    start = threading.Barrier(len(engines))
    found: list[object] = []

    def bind(engine: Engine) -> None:
        start.wait()
        try:
            found.append(engine.upkeep.bind(create=True))
        except Exception as exc:  # noqa: BLE001 - collected, asserted below
            found.append(exc)

    threads = [threading.Thread(target=bind, args=(e,)) for e in engines]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for engine in engines:
        engine.close()
    assert len(set(found)) == 1, found
    assert isinstance(found[0], str)


def test_a_replica_that_sees_the_store_bound_while_it_checks_agrees(tmp_path: Path) -> None:
    """The interleaving the threads above hit now and then, made to happen: this
    process reads no identity, then another replica of its catalog binds the store
    before this one looks for objects there."""
    from r3store.storage import binding
    from r3store.storage.store import LocalStore

    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    store = LocalStore(tmp_path / "objects")
    other = Engine(LocalStore(tmp_path / "objects"), Catalog(url))

    class BoundWhileListed(LocalStore):
        def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
            if not (tmp_path / "objects" / IDENTITY_KEY).exists():
                other.upkeep.bind(create=True)
            return super().list(prefix)

    catalog = Catalog(url)
    try:
        found = binding.bind(BoundWhileListed(tmp_path / "objects"), catalog, create=True)
        assert found == other.upkeep.bind(create=False)
        assert json.loads(store.get(IDENTITY_KEY))["catalog"] == found
    finally:
        catalog.close()
        other.close()


def test_a_start_that_cannot_succeed_once_the_database_is_back_stops_the_server(
    tmp_path: Path, postgres_server: Postgres
) -> None:
    name = f"r3_{uuid.uuid4().hex[:12]}"
    url = postgres_server.database(name)
    (tmp_path / "objects").mkdir()
    other = {"catalog": "0" * 32, "created_at": 0, "format": 1}
    (tmp_path / "objects" / IDENTITY_KEY).write_text(json.dumps(other))  # another's store
    postgres_server.allow_connections(name, False)
    server = ServerProcess(tmp_path, None, catalog_url=url, wait=False)
    try:
        assert _first_answer(server).status_code == 503  # waiting for its database
    finally:
        postgres_server.allow_connections(name, True)
    log = _exits(server, 90)
    assert server.process.returncode == 3
    assert f"belongs to catalog {'0' * 32}" in log
