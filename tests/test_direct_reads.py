"""Direct reads on real S3: the server plans, the client fetches the bytes from
SeaweedFS with presigned URLs; expiry, revoked keys and the embedded store."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Generator, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch
import urllib3

from helpers import SPEC, eventually, make_write
from http_helpers import KEYS, ServerProcess
from r3store.errors import InvalidInput, StoreError, Unauthorized
from r3store.protocol.plans import ReadPlan
from r3store.records import TrajectoryWrite
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import Client
from r3store_client.reader import TrainerReader

pytestmark = pytest.mark.s3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("direct"), seaweed) as process:
        yield process


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    with Client(server.url, api_key=KEYS["admin"]) as made:
        made.create_namespace("direct", SPEC)
        yield made


def _writes() -> list[TrajectoryWrite]:
    writes = [make_write(f"d{i}") for i in range(6)]
    tail = make_write("d0-tail", tokens=40)  # a second segment of d0
    return [*writes, TrajectoryWrite("d0", 40, topk=tail.topk, start=writes[0].num_tokens)]


def test_direct_reads_equal_reads_through_the_server(client: Client) -> None:
    client.put("direct", _writes()[:6])
    client.put("direct", _writes()[6:])
    ids = ["d3", "d0", "nope", "d5"]
    plan = client.plan("direct", ids)
    assert plan.missing == ["nope"]
    assert all(o.url.startswith("http") and "Signature" in o.url for o in plan.objects)
    spec, direct = client.fetch_direct("direct", ids)
    _, proxied = client.fetch("direct", ids, decode=False)
    assert direct.ids == proxied.ids
    assert direct.missing == proxied.missing == ["nope"]
    for a, b in zip(direct.items, proxied.items, strict=True):
        if b is None:
            assert a is None
            continue
        assert a is not None
        assert (a.trajectory_id, a.num_tokens, a.group_id) == (
            b.trajectory_id,
            b.num_tokens,
            b.group_id,
        )
        for x, y in zip(a.segments, b.segments, strict=True):  # digests included
            assert x.encoded is not None
            assert y.encoded is not None
            assert x.encoded == y.encoded
            assert x.digest == y.digest == x.encoded.digest != b""
    assert len(direct.items[1].segments) == 2  # type: ignore[union-attr]
    via_server = TrainerReader(client, "direct").fetch(["d3", "d0", "d5"])
    via_store = TrainerReader(client, "direct", direct=True).fetch(["d3", "d0", "d5"])
    assert torch.equal(via_store.ids, via_server.ids)
    assert torch.equal(via_store.widen().valid, via_server.widen().valid)
    assert spec == SPEC


def test_urls_expire_and_the_client_plans_again(
    client: Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    client.put("direct", _writes()[:2])
    # presigned expiry is in whole seconds: a URL for 3 s works for 2 s at least
    expired = client.plan("direct", ["d1"], expires=3)
    byte_range = expired.objects[0].ranges[0]
    headers = {"Range": f"bytes={byte_range.start}-{byte_range.end - 1}"}
    assert httpx.get(expired.objects[0].url, headers=headers).status_code == 206
    time.sleep(4.5)
    assert httpx.get(expired.objects[0].url, headers=headers).status_code == 403
    plans: list[object] = []
    fresh = client._plan  # the call every transport runs

    def plan(*args: Any, **kwargs: Any) -> Generator[Any, Any, ReadPlan]:
        plans.append(args)
        if len(plans) == 1:
            return expired
        return (yield from fresh(*args, **kwargs))

    monkeypatch.setattr(client, "_plan", plan)
    batch = client.fetch_direct("direct", ["d1"])[1]
    assert batch.items[0] is not None
    assert len(plans) == 2  # the expired plan was refused by the store, then planned again


def test_a_revoked_key_gets_no_new_plans(server: ServerProcess, client: Client) -> None:
    client.put("direct", _writes()[:1])
    made = server.cli("keys", "create", "trainer", "--role", "reader", "--namespace", "direct")
    key = made["key"]
    headers = {"Authorization": f"Bearer {key}"}
    known = f"{server.url}/v1/namespaces/direct"
    eventually(  # the server rereads the catalog's keys every 5 s
        lambda: httpx.get(known, headers=headers).status_code == 200, "the new key taken"
    )
    with Client(server.url, api_key=key) as trainer:
        plan = trainer.plan("direct", ["d0"], expires=2)
        assert trainer.fetch_direct("direct", ["d0"])[1].items[0] is not None
        server.cli("keys", "revoke", "trainer")
        eventually(
            lambda: httpx.get(known, headers=headers).status_code == 401, "the revoked key refused"
        )
        with pytest.raises(Unauthorized):
            trainer.plan("direct", ["d0"])
        with pytest.raises(Unauthorized):
            trainer.fetch_direct("direct", ["d0"])
    time.sleep(max(0.0, plan.expires_at - time.time()) + 0.5)
    byte_range = plan.objects[0].ranges[0]
    headers = {"Range": f"bytes={byte_range.start}-{byte_range.end - 1}"}
    assert httpx.get(plan.objects[0].url, headers=headers).status_code == 403  # its URLs too


def test_the_embedded_store_refuses_direct_reads(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path, None)
    try:
        with Client(server.url, api_key=KEYS["admin"]) as client:
            client.create_namespace("local", SPEC)
            client.put("local", [make_write("l0")])
            with pytest.raises(InvalidInput, match="direct reads need an object store"):
                client.plan("local", ["l0"])
            assert client.fetch("local", ["l0"])[1].items[0] is not None
    finally:
        server.stop()


def test_planned_ranges_cover_exactly_the_streams(client: Client) -> None:
    client.put("direct", _writes()[:6])
    plan = client.plan("direct", [f"d{i}" for i in range(6)])
    covered = sum(r.length for o in plan.objects for r in o.ranges)
    spans = [s for g in plan.segments for s in g.spans.spans]
    assert covered >= sum(s.length for s in spans)
    assert covered <= sum(s.length for s in spans) + 64 * 1024 * len(spans)  # small gaps only
    assert np.all([g.num_tokens > 0 for g in plan.segments])


class _Counting(urllib3.PoolManager):
    """The object store's connections as a caller might give them (a proxy, TLS
    settings): real connections, counted."""

    def __init__(self) -> None:
        super().__init__(maxsize=4, retries=False)
        self.urls: list[str] = []

    def request(self, method: str, url: str, *args: Any, **kwargs: Any) -> Any:
        self.urls.append(url)
        return super().request(method, url, *args, **kwargs)


def test_the_object_stores_connections_can_be_given(server: ServerProcess) -> None:
    client = Client(server.url, api_key=KEYS["admin"])
    client.create_namespace("given", SPEC)
    client.put("given", _writes()[:3])
    given = _Counting()
    with Client(server.url, api_key=KEYS["admin"], store_http=given) as mine:
        _, batch = mine.fetch_direct("given", ["d0", "d2"])
        assert batch.items[0] is not None
        assert given.urls  # every range through the connections given
        assert all("Signature" in url for url in given.urls)
    assert given.pools  # closing the client leaves a caller's connections to the caller
    broken = urllib3.PoolManager(retries=False)
    with Client(server.url, api_key=KEYS["admin"], store_http=broken) as other:
        plan = other.plan("given", ["d1"])
        moved = dataclasses.replace(
            plan,
            objects=[dataclasses.replace(o, url="http://127.0.0.1:9/x") for o in plan.objects],
        )
        with pytest.raises(StoreError, match="cannot read from the object store"):
            other._read_planned(moved)
    client.close()
