"""Lost answers, a database outage, a stalled object store and more uploads than memory:
nothing acknowledged is lost, every request is answered in bounded time, and the
service recovers without a restart."""

from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from helpers import SPEC, eventually, expected_ids, make_write
from http_helpers import KEYS, SPEC_JSON, ServerProcess, gauge
from r3store.engine import Engine
from r3store.errors import ObjectExists, StoreError
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.storage.catalog import Catalog
from r3store.storage.store import S3Store
from r3store.testing import seaweedfs
from r3store.testing.postgres import Postgres
from r3store.testing.proxy import FaultyProxy
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import Client
from r3store_client.client import Retry

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


def proxied_store(seaweed: SeaweedFS, proxy: FaultyProxy) -> S3Store:
    config = seaweed.config(f"t-{uuid.uuid4().hex[:12]}", read_timeout=5.0, max_attempts=3)
    return S3Store(dataclasses.replace(config, endpoint_url=proxy.url))


@pytest.fixture
def proxy(seaweed: SeaweedFS) -> Iterator[FaultyProxy]:
    host, port = seaweed.endpoint_url.removeprefix("http://").split(":")
    with FaultyProxy(host, int(port)) as made:
        yield made


def test_create_only_put_whose_answer_was_lost(seaweed: SeaweedFS, proxy: FaultyProxy) -> None:
    """The first attempt lands, its answer is lost, boto3's retry finds the object (412):
    the put has succeeded. Other content under the key is still refused."""
    store = proxied_store(seaweed, proxy)
    try:
        data = os.urandom(100_000)
        proxy.lose_answers(1)
        store.put_if_absent("shards/a.parquet", data)
        assert proxy.lost == 1
        assert store.get("shards/a.parquet") == data
        proxy.lose_answers(1)
        with pytest.raises(ObjectExists):
            store.put_if_absent("shards/a.parquet", data[:-1] + b"x")
        assert proxy.lost == 2
    finally:
        store.close()


def test_engine_put_survives_a_lost_answer(
    tmp_path: Path, seaweed: SeaweedFS, proxy: FaultyProxy
) -> None:
    with Engine(proxied_store(seaweed, proxy), Catalog(f"sqlite:///{tmp_path / 'c.db'}")) as engine:
        engine.namespaces.create("ns", SPEC)
        write = make_write("lost-answer")
        proxy.lose_answers(1)
        [result] = engine.put("ns", [write])
        assert result.created
        assert proxy.lost == 1
        assert np.array_equal(engine.get("ns", "lost-answer").to_topk(), expected_ids(write))


@pytest.fixture
def pg_database(postgres_server: Postgres) -> tuple[str, str]:
    name = f"r3_{uuid.uuid4().hex[:12]}"
    return name, postgres_server.database(name)


def test_catalog_outage_is_a_retryable_503_and_sampling_is_not_retried(
    tmp_path: Path, postgres_server: Postgres, pg_database: tuple[str, str]
) -> None:
    name, url = pg_database
    server = ServerProcess(tmp_path, None, catalog_url=url, env={"R3STORE_CATALOG_TIMEOUT": "2"})
    sent: list[str] = []

    def count(request: httpx.Request) -> None:
        sent.append(request.url.path)

    http = httpx.Client(base_url=server.url, event_hooks={"request": [count]}, timeout=30)
    client = Client(server.url, KEYS["admin"], http=http, retry=Retry(attempts=3, backoff=0.05))
    try:
        client.create_namespace("ns", SPEC)
        client.put("ns", [make_write("before")])
        postgres_server.allow_connections(name, False)
        try:
            with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as raw:
                r = raw.post("/v1/namespaces/ns/routes/batch", json={"ids": ["before"]})
                assert r.status_code == 503, r.text
                assert r.json()["error"]["code"] == "store_error"
                assert int(r.headers["retry-after"]) >= 1
                started = time.monotonic()
                ready = raw.get("/readyz")
                assert ready.status_code == 503
                assert time.monotonic() - started < 5
            sent.clear()
            with pytest.raises(StoreError):
                client.sample("ns", 1)
            assert sent == ["/v1/namespaces/ns/routes/sample"]  # once: it may have counted
            sent.clear()
            with pytest.raises(StoreError):
                client.put("ns", [make_write("during")])
            assert len(sent) == 3  # uploads are idempotent: retried
        finally:
            postgres_server.allow_connections(name, True)
        # recovery, without a restart
        client.put("ns", [make_write("after")])
        batch = client.get_batch("ns", ["before", "after"])
        assert batch.missing == []
        assert httpx.get(f"{server.url}/readyz").status_code == 200
    finally:
        client.close()
        http.close()
        server.stop()


def test_memory_budget_admits_uploads_or_answers_429(tmp_path: Path) -> None:
    limit = 1 << 20
    server = ServerProcess(
        tmp_path,
        None,
        env={
            "R3STORE_MAX_BODY_BYTES": str(limit),
            "R3STORE_UPLOAD_MEMORY_BYTES": str(3 * limit),
            "R3STORE_UPLOAD_MEMORY_PER_KEY": str(3 * limit),  # one key may hold it all
            "R3STORE_BODY_TIMEOUT": "60",  # the slow body below takes its time
        },
    )
    body = encode_writes([make_write("big", tokens=9000)])  # 576 KB of int32 routes
    assert limit // 2 < len(body) < limit
    headers = {**ADMIN, "Content-Type": CONTENT_TYPE}
    release = threading.Event()
    answers: list[int] = []

    def slow_body() -> Iterator[bytes]:
        yield body[:1000]
        release.wait(30)
        yield body[1000:]

    def slow_upload() -> None:
        with httpx.Client(timeout=60) as http:
            r = http.post(
                f"{server.url}/v1/namespaces/ns/trajectories",
                content=slow_body(),
                headers={**headers, "Content-Length": str(len(body))},
            )
            answers.append(r.status_code)

    try:
        with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as http:
            assert (
                http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON}).status_code
                == 201
            )
            holder = threading.Thread(target=slow_upload)
            holder.start()
            eventually(
                lambda: gauge(http, "r3store_memory_held_bytes") >= 3 * len(body),
                "the slow upload holds 3x its body",
            )
            other = encode_writes([make_write("other", tokens=9000)])
            refused = http.post("/v1/namespaces/ns/trajectories", content=other, headers=headers)
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "backpressure"
            assert int(refused.headers["retry-after"]) >= 1
            release.set()
            holder.join(60)
            assert answers == [200]
            again = http.post("/v1/namespaces/ns/trajectories", content=other, headers=headers)
            assert again.status_code == 200, again.text
            # a body of unknown length is counted as it arrives
            chunked = http.post(
                "/v1/namespaces/ns/trajectories",
                content=iter([other[:5000], other[5000:]]),
                headers=headers,
            )
            assert chunked.status_code == 200, chunked.text
            assert http.get("/v1/namespaces/ns").json()["trajectories"] == 2
    finally:
        release.set()
        server.stop()


@pytest.mark.slow
def test_a_stalled_store_loses_nothing_and_answers_in_bounded_time(tmp_path: Path) -> None:
    """SeaweedFS stopped (SIGSTOP) for longer than the S3 read timeout while writers
    upload: every request answers within the deadline, every upload is acknowledged
    in the end and readable, and the service recovers without a restart. The writers
    upload through the server: a direct write's PUT goes to the store itself, where
    the client's own timeout bounds it, so a stall that found every writer there would
    show the server nothing to answer."""
    weed = seaweedfs.start()
    deadline = 4.0
    server = ServerProcess(
        tmp_path,
        weed,
        env={
            "R3STORE_S3__READ_TIMEOUT": "1",
            "R3STORE_S3__CONNECT_TIMEOUT": "1",
            "R3STORE_S3__MAX_ATTEMPTS": "2",
            "R3STORE_REQUEST_TIMEOUT": str(deadline),
            "R3STORE_READINESS_TIMEOUT": "1",
            "R3STORE_MAINTENANCE_INTERVAL": "0",
        },
    )
    latencies: list[float] = []
    statuses: list[int] = []
    lock = threading.Lock()

    def start(request: httpx.Request) -> None:
        request.extensions["started"] = time.monotonic()

    def timed(response: httpx.Response) -> None:
        with lock:
            latencies.append(time.monotonic() - response.request.extensions["started"])
            statuses.append(response.status_code)

    acked: dict[str, Any] = {}
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def writer(w: int) -> None:
        http = httpx.Client(
            base_url=server.url, event_hooks={"request": [start], "response": [timed]}, timeout=60
        )
        client = Client(
            server.url,
            KEYS["writer"],
            http=http,
            retry=Retry(attempts=100, backoff=0.2, max_backoff=1.0),
            direct_writes=False,
        )
        i = 0
        while not stop.is_set():
            write = make_write(f"w{w}-{i}")
            client.put("ns", [write])
            with lock:
                acked[write.trajectory_id] = write
            i += 1
        client.close()
        http.close()

    try:
        with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as http:
            assert (
                http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON}).status_code
                == 201
            )
            threads += [threading.Thread(target=writer, args=(w,)) for w in range(3)]
            for t in threads:
                t.start()
            eventually(lambda: len(acked) >= 6, "writes acknowledged before the stall")
            weed.process.send_signal(signal.SIGSTOP)
            try:
                time.sleep(1.5)  # past the readiness probe's timeout
                started = time.monotonic()
                ready = http.get("/readyz")
                ready_seconds = time.monotonic() - started
                eventually(lambda: 503 in statuses, "a write answered 503 in the stall", 60)
            finally:
                weed.process.send_signal(signal.SIGCONT)
            resumed = len(acked)
            eventually(lambda: len(acked) > resumed + 3, "writes acknowledged after the stall")
            stop.set()
            for t in threads:
                t.join(120)
            assert ready.status_code == 503
            assert ready_seconds < 3
            assert http.get("/readyz").status_code == 200
            assert 503 in statuses  # the stall was seen
            assert max(latencies) < deadline + 2
            ids = sorted(acked)
            assert len(ids) > 10
            got = httpx.post(
                f"{server.url}/v1/namespaces/ns/routes/batch",
                json={"ids": ids},
                headers={"Authorization": f"Bearer {KEYS['reader']}"},
                timeout=60,
            )
            batch = decode_batch(got.content)[1]
            assert batch.missing == []
            for tid, item in zip(ids, batch.items, strict=True):
                assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid]))
    finally:  # the writers end their put against a live store and server, then stop
        weed.process.send_signal(signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(120)
        server.stop()
        weed.stop()
