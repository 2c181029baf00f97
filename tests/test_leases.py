"""Leases, step checkpoints and resume through the public clients, against a real server
process on real S3 (SeaweedFS), with maintenance running every second so eviction
after sampling happens within a test."""

from __future__ import annotations

import asyncio
import pickle
import re
import time
from collections.abc import Iterator

import httpx
import numpy as np
import pytest

from helpers import eventually, expected_ids, make_write
from http_helpers import (
    KEYS,
    ServerProcess,
    client_for,
    namespace_named_after,
    server_maintained_each_second,
)
from r3store.errors import (
    Conflict,
    Fenced,
    Forbidden,
    InvalidInput,
    LeaseClosed,
    LeaseCommitted,
    LeaseExpired,
    NotFound,
)
from r3store.leases import Lease, LeaseState
from r3store.policy import Leasing, NamespaceSettings, Retention
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import AsyncClient, Client

EVICTING = NamespaceSettings(
    max_times_sampled=1, retention=Retention(evict_after_sampled=True, keep_checkpoints=2)
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    with server_maintained_each_second(tmp_path_factory.mktemp("leases"), seaweed) as process:
        yield process


def _namespace(client: Client, request: pytest.FixtureRequest, settings: NamespaceSettings) -> str:
    name = namespace_named_after(request, client, settings)
    for i in range(12):  # one put each: first stored in this order (FIFO's)
        client.put(name, [make_write(f"t{i:02d}")])
    return name


@pytest.fixture
def namespace(client: Client, request: pytest.FixtureRequest) -> str:
    return _namespace(client, request, EVICTING)


def _ids(n: int, start: int = 0) -> tuple[str, ...]:
    return tuple(f"t{i:02d}" for i in range(start, start + n))


def test_a_lease_is_counted_once_on_commit_and_ranks_share_it(
    client: Client, namespace: str
) -> None:
    lease = client.lease(namespace, n=4, seconds=60)
    assert lease.trajectory_ids == _ids(4)
    assert (lease.state, lease.epoch, lease.seq) == (LeaseState.OPEN, 0, None)
    shared = pickle.loads(pickle.dumps(lease))  # what rank 0 broadcasts
    halves = [client.read_lease(shared, rank, 2) for rank in range(2)]
    assert [b.ids for b in halves] == [list(_ids(2)), list(_ids(2, 2))]
    for batch in halves:
        for tid, item in zip(batch.ids, batch.items, strict=True):
            assert item is not None
            np.testing.assert_array_equal(item.routes.to_topk(), expected_ids(make_write(tid)))
    assert client.lease(namespace, n=4).trajectory_ids == _ids(4, 4)  # held: not taken again
    assert client.sample(namespace, 2).ids == list(_ids(2, 8))  # nor sampled
    done = client.commit(shared)
    assert (done.state, done.seq) == (LeaseState.COMMITTED, 2)  # the sample was number 1
    with pytest.raises(LeaseCommitted, match="committed already"):
        client.commit(lease)
    with pytest.raises(LeaseCommitted):
        client.release(lease)
    assert client.get_lease(lease).state == LeaseState.COMMITTED
    # committed once, under max_times_sampled=1: never offered again
    taken = client.lease(namespace, n=12).trajectory_ids
    assert not set(taken) & set(_ids(4))


def test_a_commit_retried_with_its_token_is_answered_again(client: Client, namespace: str) -> None:
    lease = client.lease(namespace, n=2)
    path = f"{client.base_url}/v1/namespaces/{namespace}/leases/{lease.lease_id}/commit"
    headers = {"Authorization": f"Bearer {KEYS['admin']}"}
    token = "ab" * 16
    first = httpx.post(path, json={"token": token}, headers=headers)
    again = httpx.post(path, json={"token": token}, headers=headers)
    other = httpx.post(path, json={"token": "cd" * 16}, headers=headers)
    assert (first.status_code, again.status_code) == (200, 200)
    assert first.json() == again.json()
    assert (other.status_code, other.json()["error"]["code"]) == (409, "lease_committed")
    assert client.lease(namespace, n=12).trajectory_ids == _ids(10, 2)  # counted once


def test_expired_and_released_leases_give_their_trajectories_back(
    client: Client, namespace: str
) -> None:
    short = client.lease(namespace, n=3, seconds=0.3)
    released = client.lease(namespace, n=3)
    client.release(released)
    with pytest.raises(LeaseClosed, match="released"):
        client.commit(released)
    assert client.leases(namespace)[1] == [short]
    time.sleep(0.5)
    assert client.get_lease(short).state == LeaseState.EXPIRED  # before anything marks it
    with pytest.raises(LeaseExpired, match="expired"):
        client.commit(short)
    with pytest.raises(LeaseExpired):
        client.renew(short, 60)
    assert client.leases(namespace) == (0, [])
    # both went back uncounted: FIFO takes them again, in the same order
    assert client.lease(namespace, n=6).trajectory_ids == _ids(6)


def test_a_renewed_lease_outlives_its_first_expiry(client: Client, namespace: str) -> None:
    lease = client.lease(namespace, n=2, seconds=0.4)
    renewed = client.renew(lease, 30)
    assert renewed.expires_at > lease.expires_at + 20
    time.sleep(0.6)
    assert client.commit(lease).state == LeaseState.COMMITTED


def test_leasing_named_trajectories(client: Client, namespace: str) -> None:
    lease = client.lease(namespace, trajectory_ids=["t05", "t01"])
    assert lease.trajectory_ids == ("t05", "t01")
    with pytest.raises(Conflict, match=r"not free to take.*'t01'"):
        client.lease(namespace, trajectory_ids=["t02", "t01"])  # t01 is held
    with pytest.raises(Conflict, match="'nope'"):
        client.lease(namespace, trajectory_ids=["nope"])
    client.commit(lease)
    with pytest.raises(Conflict, match="'t05'"):  # sampled its one time
        client.lease(namespace, trajectory_ids=["t05"])
    assert client.lease(namespace, trajectory_ids=["t02"]).trajectory_ids == ("t02",)


def test_resume_hands_out_again_what_was_consumed_after_the_checkpoint(
    client: Client, namespace: str
) -> None:
    for step in range(2):
        client.commit(client.lease(namespace, n=2))
        point = client.checkpoint(namespace, step)
        assert (point.step, point.consumed, point.epoch) == (step, step + 1, 0)
    assert client.checkpoint(namespace, 1) == point  # the same step again: the same one
    seen = []
    for _ in range(2):  # steps 2 and 3: consumed after checkpoint 1, then the trainer dies
        lease = client.lease(namespace, n=2)
        seen.append(lease.trajectory_ids)
        client.commit(lease)
    client.checkpoint(namespace, 3)
    zombie = client.lease(namespace, n=2)  # taken, never committed: the crash
    # maintenance (every second) evicts what was sampled its one time, unless kept:
    # consumed up to the oldest kept checkpoint (1; keep_checkpoints=2 dropped 0)
    eventually(
        lambda: client.get_batch(namespace, list(_ids(8))).missing == list(_ids(4)),
        "what was consumed before checkpoint 1 evicted, nothing else",
    )
    done = client.resume(namespace, 1)
    assert (done.epoch, done.leases_undone, done.samplings_undone) == (1, 2, 4)
    assert (done.leases_fenced, done.checkpoints_dropped) == (1, [3])
    assert [c.step for c in client.checkpoints(namespace)[1]] == [1]
    with pytest.raises(Fenced, match="resumed"):
        client.commit(zombie)
    with pytest.raises(Fenced):
        client.lease(namespace, n=2, epoch=0)
    with pytest.raises(Fenced):
        client.checkpoint(namespace, 2, epoch=0)
    again = [client.lease(namespace, n=2, epoch=done.epoch) for _ in range(2)]
    assert [lease.trajectory_ids for lease in again] == seen  # the same batches, in order
    for lease in again:
        assert not client.read_lease(lease).missing  # kept for the resume
        client.commit(lease)
    assert client.checkpoint(namespace, 2, epoch=1).consumed > point.consumed


def _passes(client: Client) -> int:
    """Maintenance passes the server has run (its /metrics)."""
    text = client.request("GET", "/metrics").text
    found = re.search(r"^r3store_maintenance_passes_total (\S+)$", text, re.M)
    assert found is not None
    return int(float(found.group(1)))


def test_deleting_checkpoints_lets_eviction_go_on(client: Client, namespace: str) -> None:
    client.checkpoint(namespace, 0)
    client.commit(client.lease(namespace, n=3))
    after = _passes(client)
    eventually(lambda: _passes(client) >= after + 2, "two maintenance passes since the commit")
    assert client.get_batch(namespace, list(_ids(3))).missing == []  # kept for checkpoint 0
    client.delete_checkpoint(namespace, 0)
    with pytest.raises(NotFound, match="no checkpoint at step 0"):
        client.delete_checkpoint(namespace, 0)
    deadline = time.monotonic() + 10
    while client.get_batch(namespace, list(_ids(3))).missing != list(_ids(3)):
        assert time.monotonic() < deadline, "eviction did not run"
        time.sleep(0.3)


def test_rights_and_bad_requests(server: ServerProcess, client: Client, namespace: str) -> None:
    with client_for(server, "reader") as reader, client_for(server, "trainer") as trainer:
        lease = reader.lease(namespace, n=1)
        assert lease.holder == "reader"
        reader.commit(lease)
        with pytest.raises(Forbidden):
            reader.checkpoint(namespace, 0)
        with pytest.raises(Forbidden):
            reader.resume(namespace, 0)
        assert trainer.checkpoint(namespace, 0).step == 0
    with client_for(server, "writer") as writer, pytest.raises(Forbidden):
        writer.lease(namespace, n=1)
    with client_for(server, "other") as other, pytest.raises(Forbidden):
        other.lease(namespace, n=1)
    base = f"/v1/namespaces/{namespace}"
    for body in ({}, {"n": 1, "trajectory_ids": ["t00"]}, {"n": 0}, {"n": 1, "seconds": -1}):
        with pytest.raises(InvalidInput):
            client.request("POST", f"{base}/leases", json=body)
    with pytest.raises(InvalidInput):
        client.request("POST", f"{base}/leases/not-a-lease/commit")
    with pytest.raises(NotFound):
        client.request("POST", f"{base}/leases/{'0' * 32}/commit")
    with pytest.raises(InvalidInput):
        client.lease(namespace, trajectory_ids=["t00", "t00"])
    client.commit(client.lease(namespace, n=1))
    with pytest.raises(Conflict, match="steps go forward"):
        client.checkpoint(namespace, 0)  # a repeat of 0 with consumption since
    with pytest.raises(NotFound, match=r"it has: 0"):
        client.resume(namespace, 7)
    with pytest.raises(NotFound):
        client.lease("no-such-namespace", n=1)
    fake = Lease(namespace, "f" * 32, 0, LeaseState.OPEN, (), 0.0, 0.0)
    with pytest.raises(NotFound):
        client.commit(fake)


def test_the_async_client_leases_too(server: ServerProcess, client: Client, namespace: str) -> None:
    async def step() -> tuple[Lease, list[list[str]]]:
        async with AsyncClient(server.url, api_key=KEYS["admin"]) as aio:
            lease = await aio.lease(namespace, n=4)
            halves = await asyncio.gather(*(aio.read_lease(lease, r, 2) for r in range(2)))
            done = await aio.commit(lease)
            await aio.checkpoint(namespace, 5)
            return done, [b.ids for b in halves]

    done, halves = asyncio.run(step())
    assert done.state == LeaseState.COMMITTED
    assert halves == [list(_ids(2)), list(_ids(2, 2))]
    assert [c.step for c in client.checkpoints(namespace)[1]] == [5]


def test_a_lease_belongs_to_the_key_that_took_it(
    server: ServerProcess, client: Client, namespace: str
) -> None:
    """Another reader key (a dashboard's) neither sees a trainer's lease ids nor reads,
    commits, releases or renews the lease; an admin may; a refusal changes nothing."""
    with client_for(server, "trainer") as trainer, client_for(server, "reader") as dashboard:
        lease = trainer.lease(namespace, n=4, seconds=60)
        assert dashboard.leases(namespace)[1] == []
        assert [held.lease_id for held in trainer.leases(namespace)[1]] == [lease.lease_id]
        assert [held.lease_id for held in client.leases(namespace)[1]] == [lease.lease_id]
        for act in (
            dashboard.get_lease,
            dashboard.commit,
            dashboard.release,
            lambda held: dashboard.renew(held, 3600),
        ):
            with pytest.raises(Forbidden, match="taken by another API key"):
                act(lease)
        still = trainer.get_lease(lease)
        assert still.state is LeaseState.OPEN
        assert still.expires_at == lease.expires_at  # the renewal did nothing
        assert trainer.commit(lease).state is LeaseState.COMMITTED
        other = trainer.lease(namespace, n=1)
        assert client.release(other).state is LeaseState.RELEASED  # an admin may


def test_what_one_key_may_hold_is_bounded_by_the_namespace(
    server: ServerProcess, client: Client, request: pytest.FixtureRequest
) -> None:
    settings = NamespaceSettings(leasing=Leasing(max_open=2, max_held=5, max_seconds=60))
    namespace = _namespace(client, request, settings)
    with client_for(server, "trainer") as trainer, client_for(server, "reader") as dashboard:
        with pytest.raises(InvalidInput, match=r"leasing\.max_seconds"):
            trainer.lease(namespace, n=1, seconds=61)
        first = trainer.lease(namespace, n=3, seconds=60)
        with pytest.raises(Conflict, match=r"leasing\.max_held"):
            trainer.lease(namespace, n=3, seconds=30)
        second = trainer.lease(namespace, n=2, seconds=30)
        with pytest.raises(Conflict, match=r"leasing\.max_open"):
            trainer.lease(namespace, n=1, seconds=30)
        with pytest.raises(InvalidInput, match=r"leasing\.max_seconds"):
            trainer.renew(first, 120)
        assert len(dashboard.lease(namespace, n=5, seconds=30).trajectory_ids) == 5  # its own
        assert trainer.leases(namespace)[1] == [first, second]  # refusals held nothing
        trainer.release(first)
        assert len(trainer.lease(namespace, n=3, seconds=30).trajectory_ids) == 3
