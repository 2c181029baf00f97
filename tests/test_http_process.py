"""A real uvicorn process on real S3: a round trip, and SIGKILL in a stream of writes."""

from __future__ import annotations

import threading
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import eventually, expected_ids, make_write
from http_helpers import KEYS, SPEC_JSON, ServerProcess
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.testing.seaweedfs import SeaweedFS

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


def test_round_trip_through_a_server_process(tmp_path: Path, seaweed: SeaweedFS) -> None:
    server = ServerProcess(tmp_path, seaweed)
    try:
        with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as http:
            assert (
                http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON}).status_code
                == 201
            )
            writes = [make_write(f"p{i}") for i in range(5)]
            r = http.post(
                "/v1/namespaces/ns/trajectories",
                content=encode_writes(writes),
                headers={"Content-Type": CONTENT_TYPE},
            )
            assert r.status_code == 200, r.text
            r = http.post("/v1/namespaces/ns/routes/batch", json={"ids": ["p4", "p0", "zz"]})
            batch = decode_batch(r.content)[1]
            assert batch.missing == ["zz"]
            assert np.array_equal(batch.items[0].routes.to_topk(), expected_ids(writes[4]))
            assert r.headers["x-request-id"]
    finally:
        server.stop()
    log = (tmp_path / f"server-{server.port}.log").read_text()
    assert '"msg": "r3store serving on S3' in log
    assert '"request_id"' in log


@pytest.mark.slow
def test_sigkill_during_writes_loses_no_acknowledged_write(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    server = ServerProcess(tmp_path, seaweed)
    acked: dict[str, object] = {}
    stop = threading.Event()
    lock = threading.Lock()
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as http:
        assert (
            http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON}).status_code == 201
        )

    def writer(w: int) -> None:
        with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as http:
            n = 0
            while not stop.is_set():
                writes = [make_write(f"w{w}-{n}-{i}") for i in range(2)]
                try:
                    r = http.post(
                        "/v1/namespaces/ns/trajectories",
                        content=encode_writes(writes),
                        headers={"Content-Type": CONTENT_TYPE},
                    )
                except httpx.HTTPError:
                    return  # the server died mid-request: not acknowledged
                if r.status_code == 200:
                    with lock:
                        acked.update((x.trajectory_id, x) for x in writes)
                n += 1

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    eventually(lambda: len(acked) > 10, "some uploads acknowledged")
    server.kill()
    stop.set()
    for t in threads:
        t.join()
    assert len(acked) > 10
    restarted = ServerProcess(tmp_path, seaweed, prefix=server.prefix)
    try:
        with httpx.Client(base_url=restarted.url, headers=ADMIN, timeout=60) as http:
            ids = sorted(acked)
            r = http.post("/v1/namespaces/ns/routes/batch", json={"ids": ids})
            batch = decode_batch(r.content)[1]
            assert batch.missing == []
            for tid, item in zip(ids, batch.items, strict=True):
                assert item is not None
                assert item.routes is not None
                assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid]))
    finally:
        restarted.stop()
