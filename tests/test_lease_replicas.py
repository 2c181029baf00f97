"""Leases on two replicas sharing one PostgreSQL catalog and one bucket: a lease taken on
one is read, committed, checkpointed and resumed through the other; concurrent commits
of one lease count it once; concurrent leases never hold a trajectory twice; a commit
racing its lease's expiry either counts or hands the trajectories back, never both (and
is judged by the time at which it holds the namespace's lock)."""

from __future__ import annotations

import random
import secrets
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import partial
from typing import Any

import httpx
import numpy as np
import pytest

from helpers import SPEC, expected_ids, make_write
from http_helpers import KEYS, SPEC_JSON, ServerProcess, replicas
from r3store.engine import Engine
from r3store.errors import Conflict, Fenced, LeaseExpired
from r3store.leases import Lease, LeaseState
from r3store.policy import ENGINE, NamespaceSettings
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.testing.postgres import Postgres
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client.client import Client

pytestmark = pytest.mark.slow
ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}


@dataclass
class Pair:
    a: ServerProcess
    b: ServerProcess
    pg_url: str
    catalog: Catalog  # behind the servers' backs

    def client(self, server: ServerProcess) -> Client:
        return Client(server.url, KEYS["admin"])

    def times_sampled(self, namespace: str, ids: list[str]) -> dict[str, int]:
        found = self.catalog.segments.lookup(namespace, ids)
        return {
            tid: next(s.times_sampled for s in found[tid] if s.start == 0 and s.source == ENGINE)
            for tid in ids
        }

    def fifo(self, namespace: str, ids: list[str]) -> list[str]:
        """`ids` in FIFO order (oldest committed first, as `choose` orders them)."""
        found = self.catalog.segments.lookup(namespace, ids)
        first = {tid: next(s for s in found[tid] if s.start == 0) for tid in ids}
        return sorted(ids, key=lambda tid: (first[tid].created_at, tid))


@pytest.fixture(scope="module")
def pair(
    tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS, postgres_server: Postgres
) -> Iterator[Pair]:
    pg_url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    with replicas(tmp_path_factory.mktemp("lease-replicas"), seaweed, pg_url) as (a, b):
        catalog = Catalog(pg_url)
        try:
            yield Pair(a, b, pg_url, catalog)
        finally:
            catalog.close()


def make_namespace(pair: Pair, name: str, **settings: Any) -> None:
    body = {"name": name, "spec": SPEC_JSON, "settings": settings}
    r = httpx.post(f"{pair.a.url}/v1/namespaces", json=body, headers=ADMIN, timeout=60)
    assert r.status_code == 201, r.text


def upload(server: ServerProcess, namespace: str, writes: list[TrajectoryWrite]) -> None:
    r = httpx.post(
        f"{server.url}/v1/namespaces/{namespace}/trajectories",
        content=encode_writes(writes),
        headers={**ADMIN, "Content-Type": CONTENT_TYPE},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def stored(pair: Pair, namespace: str, count: int, per_upload: int = 10) -> list[str]:
    """`count` trajectories uploaded in turn through both replicas; their ids."""
    ids = [f"{namespace}-{i:04d}" for i in range(count)]
    for n, begin in enumerate(range(0, count, per_upload)):
        server = (pair.a, pair.b)[n % 2]
        upload(server, namespace, [make_write(tid) for tid in ids[begin : begin + per_upload]])
    return ids


def commit_raw(
    http: httpx.Client, server: ServerProcess, lease: Lease, token: str
) -> httpx.Response:
    return http.post(
        f"{server.url}/v1/namespaces/{lease.namespace}/leases/{lease.lease_id}/commit",
        json={"token": token},
    )


def code(r: httpx.Response) -> str | None:
    return None if r.status_code < 400 else str(r.json()["error"]["code"])


def at_once(jobs: list[Callable[[], Any]]) -> list[Any]:
    """Run the jobs on threads of their own, released together by a barrier."""
    barrier = threading.Barrier(len(jobs))

    def run(job: Callable[[], Any]) -> Any:
        barrier.wait(30)
        return job()

    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(run, jobs))


def test_a_lease_moves_between_replicas(pair: Pair) -> None:
    """Taken on A, read and committed on B, checkpointed on A, resumed on B: a lease of
    the run before the resume is refused on A."""
    ns = "handoff"
    make_namespace(pair, ns, max_times_sampled=1)
    ids = stored(pair, ns, 12, per_upload=3)
    order = pair.fifo(ns, ids)
    writes = {tid: make_write(tid) for tid in ids}
    a, b = pair.client(pair.a), pair.client(pair.b)
    try:
        lease = a.lease(ns, n=4, seconds=60)
        assert list(lease.trajectory_ids) == order[:4]
        assert b.get_lease(lease).state is LeaseState.OPEN
        for rank in range(2):
            batch = b.read_lease(lease, rank, 2)
            assert batch.ids == list(lease.slice(rank, 2))
            assert batch.missing == []
            for tid, item in zip(batch.ids, batch.items, strict=True):
                assert item is not None
                assert item.routes is not None
                assert np.array_equal(item.routes.to_topk(), expected_ids(writes[tid]))
        done = b.commit(lease)
        assert done.state is LeaseState.COMMITTED
        assert done.seq == 1
        assert a.get_lease(lease).state is LeaseState.COMMITTED
        assert pair.times_sampled(ns, order[:4]) == dict.fromkeys(order[:4], 1)

        point = a.checkpoint(ns, 1)
        assert point.consumed == 1
        assert point.epoch == 0
        later = b.lease(ns, n=4, seconds=60)  # committed after the checkpoint: undone
        assert list(later.trajectory_ids) == order[4:8]
        assert a.commit(later).seq == 2
        held = a.lease(ns, n=2, seconds=60)  # open at the resume: fenced
        assert list(held.trajectory_ids) == order[8:10]

        resumed = b.resume(ns, 1)
        assert resumed.epoch == 1
        assert (resumed.leases_undone, resumed.samplings_undone, resumed.leases_fenced) == (1, 4, 1)
        with pytest.raises(Fenced):
            a.commit(held)
        assert a.get_lease(held).state is LeaseState.FENCED
        with pytest.raises(Fenced):
            a.lease(ns, n=1, seconds=60, epoch=0)
        with pytest.raises(Fenced):
            a.checkpoint(ns, 2, epoch=0)
        counts = pair.times_sampled(ns, ids)
        assert counts == {tid: int(tid in order[:4]) for tid in ids}
        # what the resume undid and fenced is handed out again, in the same FIFO order
        again = a.lease(ns, n=8, seconds=60, epoch=resumed.epoch)
        assert list(again.trajectory_ids) == order[4:12]
        assert b.commit(again).seq == 2  # the resume set the count back to step 1's
        assert b.leases(ns) == (1, [])
    finally:
        a.close()
        b.close()


def test_concurrent_commits_of_one_lease_count_it_once(pair: Pair) -> None:
    """8 threads per replica commit the same lease at once, each with its own token:
    one 200, fifteen 409 lease_committed, each trajectory counted once. The same token
    twice at once is one commit and its retry: both 200, counted once."""
    ns = "commits"
    make_namespace(pair, ns)
    leases_n, retried_n, size, per_replica = 30, 10, 2, 8
    ids = stored(pair, ns, (leases_n + retried_n) * size)
    a = pair.client(pair.a)
    try:
        taken = [a.lease(ns, n=size, seconds=120) for _ in range(leases_n + retried_n)]
    finally:
        a.close()
    assert len({tid for lease in taken for tid in lease.trajectory_ids}) == len(ids)
    servers = [pair.a] * per_replica + [pair.b] * per_replica
    https = [httpx.Client(headers=ADMIN, timeout=60) for _ in servers]  # one per thread
    outcomes: Counter[str] = Counter()
    retries: Counter[str] = Counter()
    wrong: list[str] = []
    try:
        for lease in taken[:leases_n]:
            answers = at_once(
                [
                    partial(commit_raw, h, s, lease, secrets.token_hex(16))
                    for s, h in zip(servers, https, strict=True)
                ]
            )
            got = Counter((r.status_code, code(r)) for r in answers)
            outcomes.update(f"{r.status_code} {code(r) or 'ok'}" for r in answers)
            if got != Counter({(200, None): 1, (409, "lease_committed"): len(servers) - 1}):
                wrong.append(f"{lease.lease_id}: {dict(got)}")
        # a commit and its retry, on both replicas at once
        for n, lease in enumerate(taken[leases_n:]):
            token = secrets.token_hex(16)
            first, second = (pair.a, pair.b) if n % 2 else (pair.b, pair.a)
            answers = at_once(
                [
                    partial(commit_raw, https[0], first, lease, token),
                    partial(commit_raw, https[1], second, lease, token),
                ]
            )
            retries.update(str(r.status_code) for r in answers)
            bodies = [r.json() for r in answers]
            assert all(r.status_code == 200 for r in answers), bodies
            assert bodies[0]["seq"] == bodies[1]["seq"], bodies
            other = commit_raw(https[0], first, lease, secrets.token_hex(16))
            assert (other.status_code, code(other)) == (409, "lease_committed"), other.text
    finally:
        for h in https:
            h.close()
    counts = pair.times_sampled(ns, ids)
    double = sum(max(0, k - 1) for k in counts.values())
    uncounted = sum(k == 0 for k in counts.values())
    print(
        f"concurrent commits: {leases_n} leases x {len(servers)} commits: {dict(outcomes)}; "
        f"retried {retried_n}: {dict(retries)}; double counts {double}, uncounted {uncounted}"
    )
    assert wrong == []
    assert double == 0, counts
    assert uncounted == 0, counts
    seqs = sorted(pair.catalog.leases.get(ns, lease.lease_id).seq or 0 for lease in taken)
    assert seqs == list(range(1, len(taken) + 1))  # one consumption number each


def test_concurrent_leases_never_overlap(pair: Pair) -> None:
    """Six threads per replica take leases of one namespace at once: no trajectory is in
    two open leases, and together they hold the oldest ones, as FIFO implies."""
    ns = "leasing"
    make_namespace(pair, ns)
    ids = stored(pair, ns, 200, per_upload=20)
    per_replica, rounds, size = 6, 3, 5
    servers = [pair.a] * per_replica + [pair.b] * per_replica

    def take(server: ServerProcess) -> Callable[[], list[Lease]]:
        def run() -> list[Lease]:
            with pair.client(server) as client:
                return [client.lease(ns, n=size, seconds=120) for _ in range(rounds)]

        return run

    taken = [lease for leases in at_once([take(s) for s in servers]) for lease in leases]
    held = Counter(tid for lease in taken for tid in lease.trajectory_ids)
    overlaps = sum(k > 1 for k in held.values())
    total = len(servers) * rounds * size
    print(f"concurrent leasing: {len(taken)} leases of {size}, {total} held, {overlaps} overlaps")
    assert overlaps == 0, [tid for tid, k in held.items() if k > 1]
    assert all(len(lease.trajectory_ids) == size for lease in taken)
    assert set(held) == set(pair.fifo(ns, ids)[:total])
    with pair.client(pair.b) as client:
        epoch, listed = client.leases(ns)
    assert epoch == 0
    assert {lease.lease_id for lease in listed} == {lease.lease_id for lease in taken}


@dataclass
class Race:
    lease: Lease
    committer: ServerProcess
    other: ServerProcess
    commit: httpx.Response | None = None
    retaken: Lease | None = None  # taken again by trajectory_ids on the other replica
    sent: float = 0.0  # when the commit was sent, from the lease's expiry


def test_a_commit_racing_its_expiry_counts_or_returns(pair: Pair) -> None:
    """Short leases committed right around their expiry, while the other replica tries
    to take their trajectories again: each either commits (counted once, not taken
    again) or answers lease_expired (nothing counted, free to take again)."""
    ns = "expiry"
    make_namespace(pair, ns, max_times_sampled=1)  # a counted trajectory is never retaken
    races_n, size = 40, 2
    ids = stored(pair, ns, races_n * size)
    rng = random.Random(1234)
    races: list[Race] = []

    def until(moment: float) -> None:
        time.sleep(max(0.0, moment - time.time()))

    def commit(race: Race, jitter: float) -> None:
        with httpx.Client(headers=ADMIN, timeout=60) as http:
            until(race.lease.expires_at + jitter)
            race.sent = time.time() - race.lease.expires_at
            race.commit = commit_raw(http, race.committer, race.lease, secrets.token_hex(16))

    def retake(race: Race, jitter: float) -> None:
        """Take the lease's trajectories on the other replica as soon as they are free,
        and commit them: a second count, if the racing commit also counted."""
        server = race.other
        body = {"trajectory_ids": list(race.lease.trajectory_ids), "seconds": 60}
        with pair.client(server) as client, httpx.Client(headers=ADMIN, timeout=60) as http:
            until(race.lease.expires_at + jitter)
            deadline = race.lease.expires_at + 0.2
            while True:
                r = http.post(f"{server.url}/v1/namespaces/{ns}/leases", json=body)
                if r.status_code == 201:
                    race.retaken = Lease.from_dict(r.json())
                    client.commit(race.retaken)
                    return
                assert (r.status_code, code(r)) == (409, "conflict"), r.text
                if time.time() > deadline:
                    return
                time.sleep(0.01)

    with (
        pair.client(pair.a) as a,
        pair.client(pair.b) as b,
        ThreadPoolExecutor(2 * races_n) as pool,
    ):
        jobs = []
        for n in range(races_n):
            client = (a, b)[n % 2]  # taken on either, committed on either
            mine = ids[n * size : (n + 1) * size]
            lease = client.lease(ns, trajectory_ids=mine, seconds=rng.uniform(0.3, 0.5))
            committer, other = (pair.a, pair.b) if rng.random() < 0.5 else (pair.b, pair.a)
            race = Race(lease, committer, other)
            races.append(race)
            jobs.append(pool.submit(commit, race, rng.uniform(-0.15, 0.02)))
            jobs.append(pool.submit(retake, race, rng.uniform(-0.02, 0.02)))
        for job in jobs:
            job.result(60)

    outcomes: Counter[str] = Counter()
    inconsistent: list[str] = []
    double = 0
    with pair.client(pair.a) as a, pair.client(pair.b) as b:
        for race in races:
            assert race.commit is not None
            lease_ids = list(race.lease.trajectory_ids)
            counts = pair.times_sampled(ns, lease_ids)
            double += sum(max(0, k - 1) for k in counts.values())
            answer = (race.commit.status_code, code(race.commit))
            outcomes[f"{answer[0]} {answer[1] or 'ok'}"] += 1
            outcomes["sent before expiry" if race.sent < 0 else "sent after expiry"] += 1
            if race.retaken is not None:
                outcomes["retaken at once"] += 1
            state = pair.catalog.leases.get(ns, race.lease.lease_id).state
            if answer == (200, None):
                ok = (
                    race.retaken is None
                    and state is LeaseState.COMMITTED
                    and counts == dict.fromkeys(lease_ids, 1)
                )
            elif answer == (409, "lease_expired"):
                ok = state in (LeaseState.OPEN, LeaseState.EXPIRED)  # never committed
                if race.retaken is not None:
                    ok = ok and counts == dict.fromkeys(lease_ids, 1)  # the retaken one's
                else:
                    ok = ok and counts == dict.fromkeys(lease_ids, 0)
                    client = a if race.other is pair.a else b
                    try:
                        again = client.lease(ns, trajectory_ids=lease_ids, seconds=60)
                        client.commit(again)
                    except Conflict:
                        ok = False
            else:
                ok = False
            if not ok:
                inconsistent.append(
                    f"lease {race.lease.lease_id} (expires {race.lease.expires_at:.3f}): "
                    f"commit {answer} at {race.commit.json().get('closed_at')}, state "
                    f"{state}, retaken {race.retaken}, counts {counts}"
                )
        left = a.lease(ns, n=len(ids), seconds=60).trajectory_ids  # none: all counted
    final = pair.times_sampled(ns, ids)
    print(
        f"commit racing expiry: {races_n} leases: {dict(outcomes)}; double counts {double}, "
        f"inconsistent {len(inconsistent)}"
    )
    for line in inconsistent:
        print(line)
    assert inconsistent == [], inconsistent
    assert left == ()
    assert double == 0
    assert final == dict.fromkeys(ids, 1)


def test_a_commit_is_judged_when_it_holds_the_lock(
    seaweed: SeaweedFS, postgres_server: Postgres
) -> None:
    """Two engines (two replicas) on one catalog: replica X starts to commit a lease a
    millisecond before its expiry, and while it does, replica Y (its clock past the
    expiry) tries to take the lease's trajectories by id. Either X's commit counts them
    and Y is refused, or X is refused and Y takes them: never both (had X judged the
    expiry by a clock read before it locked the namespace, Y's take could slip in
    between and each would count them)."""
    pg_url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    store = seaweed.new_store()
    at = [1000.0]
    other = Engine(store, Catalog(pg_url), clock=lambda: at[0])
    retaken: list[Lease] = []
    refused: list[Conflict] = []
    takes: list[threading.Thread] = []
    armed = [False]

    def take_by_id() -> None:
        try:
            retaken.append(other.consumption.lease("ns", trajectory_ids=["x"], seconds=60))
        except Conflict as exc:
            refused.append(exc)

    def committer_clock() -> float:
        """X's clock: as X reads it to commit, Y (past the expiry) takes by id."""
        if armed[0]:
            armed[0] = False
            at[0] = lease.expires_at + 0.001
            take = threading.Thread(target=take_by_id)
            takes.append(take)
            take.start()
            take.join(1)  # done at once, unless it waits for X's lock
        return lease.expires_at - 0.001

    committer = Engine(store, Catalog(pg_url), clock=committer_clock)
    try:
        other.namespaces.create("ns", SPEC, NamespaceSettings(max_times_sampled=1))
        other.put("ns", [make_write("x")])
        lease = other.consumption.lease("ns", trajectory_ids=["x"], seconds=10)
        armed[0] = True
        committed = True
        try:
            committer.consumption.commit("ns", lease.lease_id)
        except LeaseExpired:
            committed = False
        for take in takes:
            take.join(30)
        assert len(retaken) + len(refused) == 1
        for again in retaken:
            other.consumption.commit("ns", again.lease_id)
        behind = Catalog(pg_url)
        try:
            times = behind.segments.lookup("ns", ["x"])["x"][0].times_sampled
        finally:
            behind.close()
        assert committed != bool(retaken), (committed, retaken)
        assert times == 1
    finally:
        committer.close()
        other.close()
