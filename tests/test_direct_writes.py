"""Direct writes on real S3: a worker asks for a write plan, PUTs its blob to SeaweedFS
with the plan's create-only URL and commits it; the server checks every stream before
anything is acknowledged. Equal content to proxied puts, crashes, other keys, revoked
keys, replicas on PostgreSQL, hostile commits and the embedded store."""

from __future__ import annotations

import dataclasses
import json
import logging
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
from http_helpers import KEYS, ServerProcess, replicas
from r3store.engine import Engine
from r3store.engine.direct import WritePlan
from r3store.engine.rebuild import rebuild_catalog
from r3store.errors import Conflict, DirectUnavailable, PlanGone, R3StoreError, StoreError
from r3store.logic.writes import encode_write
from r3store.protocol.direct import MAX_BLOB_BYTES, DirectSegment, pack
from r3store.protocol.fields import SpanModel
from r3store.records import PutResult, TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.storage.keys import DICTIONARY_PREFIX, INDEX_PREFIX, SHARD_PREFIX, blob_of_index
from r3store.storage.store import S3Store
from r3store.testing.postgres import Postgres
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import skewed_topk
from r3store_client import Client

pytestmark = pytest.mark.s3


# helpers


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("writes"), seaweed)
    yield process
    process.stop()


@pytest.fixture(scope="module")
def objects(server: ServerProcess, seaweed: SeaweedFS) -> Iterator[S3Store]:
    """The server's objects, seen from outside it."""
    store = seaweed.new_store(prefix=server.prefix)
    yield store
    store.close()


def _namespace(server: ServerProcess, name: str | None = None) -> str:
    name = name or f"n{uuid.uuid4().hex[:10]}"
    with Client(server.url, api_key=KEYS["admin"]) as admin:
        admin.create_namespace(name, SPEC)
    return name


def _http(server: ServerProcess, key: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def _plan(http: httpx.Client, ns: str, expires: int | None = None) -> dict[str, Any]:
    body = {} if expires is None else {"expires": expires}
    r = http.post(f"/v1/namespaces/{ns}/writes", json=body)
    assert r.status_code == 201, r.text
    plan: dict[str, Any] = r.json()
    return plan


def _upload_url(http: httpx.Client, ns: str, plan: dict[str, Any], size: int) -> dict[str, Any]:
    body = {"plan": plan["plan"], "size": size}
    r = http.post(f"/v1/namespaces/{ns}/writes/upload", json=body)
    assert r.status_code == 200, r.text
    url: dict[str, Any] = r.json()
    return url


def _put(upload: dict[str, Any], blob: bytes) -> int:
    return httpx.put(upload["url"], content=blob, headers=upload["headers"], timeout=60).status_code


def _put_blob(http: httpx.Client, ns: str, plan: dict[str, Any], blob: bytes) -> int:
    """Ask for the plan's URL for the blob's size, and PUT it there: the status."""
    return _put(_upload_url(http, ns, plan, len(blob)), blob)


def _put_planned(engine: Engine, plan: WritePlan, blob: bytes) -> int:
    made = engine.direct.upload("ns", plan.plan, len(blob), "w", MAX_BLOB_BYTES)
    return _put(dataclasses.asdict(made), blob)


def _body(plan: dict[str, Any], size: int, segments: list[DirectSegment]) -> dict[str, Any]:
    return {
        "plan": plan["plan"],
        "size": size,
        "segments": [s.model_dump(mode="json", exclude_none=True) for s in segments],
    }


def _commit(http: httpx.Client, ns: str, body: dict[str, Any]) -> httpx.Response:
    return http.post(f"/v1/namespaces/{ns}/writes/commit", json=body)


def _encoded(writes: list[TrajectoryWrite]) -> tuple[bytes, list[DirectSegment]]:
    return pack([encode_write(w, SPEC) for w in writes])


def _key_of(plan: dict[str, Any]) -> str:
    """The blob key a plan's token names (its payload is plain JSON)."""
    import base64

    payload = plan["plan"].split(".")[0]
    fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
    return str(fields["k"])


def _listed(store: S3Store, prefix: str) -> set[str]:
    return {info.key for info in store.list(prefix)}


def _collect_orphans(server: ServerProcess) -> dict[str, Any]:
    """A maintenance pass that takes every upload never committed for an orphan."""
    report: dict[str, Any] = server.cli("maintain", "--orphan-age", "0", "--grace", "0")
    return report


def _results(results: list[PutResult]) -> list[tuple[Any, ...]]:
    return [
        (r.trajectory_id, r.start, r.source, r.num_tokens, r.policy_version, r.digest, r.created)
        for r in results
    ]


def _tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.int32)


def _content() -> list[list[TrajectoryWrite]]:
    """Puts in order: trajectories with token ids, groups and policy versions; then a
    second turn of t0 (start > 0) and predicted routes for t1."""
    first = []
    for i in range(5):
        base = make_write(f"t{i}", tokens=40 + 17 * i)
        first.append(
            TrajectoryWrite(
                f"t{i}",
                base.num_tokens,
                topk=base.topk,
                prompt_len=7,
                group_id=f"g{i % 2}",
                policy_version=i % 3,
                token_ids=_tokens(base.num_tokens, i),
            )
        )
    turn = make_write("t0-turn", tokens=33)
    predicted = make_write("t1-predicted", tokens=first[1].num_tokens)
    second = [
        TrajectoryWrite(
            "t0",
            33,
            topk=turn.topk,
            start=first[0].num_tokens,
            group_id="g0",
            token_ids=_tokens(33, 99),
        ),
        TrajectoryWrite("t1", predicted.num_tokens, topk=predicted.topk, source="predicted"),
    ]
    return [first, second]


# 1. equal content


def test_direct_writes_store_what_proxied_writes_store(
    server: ServerProcess, objects: S3Store, caplog: pytest.LogCaptureFixture
) -> None:
    direct_ns, proxied_ns = _namespace(server), _namespace(server)
    ids = [f"t{i}" for i in range(5)]
    acked: list[list[PutResult]] = []
    with (
        Client(server.url, api_key=KEYS["admin"]) as direct,
        Client(server.url, api_key=KEYS["admin"], direct_writes=False) as proxied,
        caplog.at_level(logging.INFO, logger="r3store_client"),
    ):
        for writes in _content():
            a = direct.put(direct_ns, writes)
            b = proxied.put(proxied_ns, writes)
            assert _results(a) == _results(b)
            assert all(r.created and r.digest for r in a)
            acked.append(a)
        assert "writes go straight to the object store" in caplog.text
        for source in (None, "engine"):
            x = direct.get_batch(direct_ns, ids, source=source)  # type: ignore[arg-type]
            y = proxied.get_batch(proxied_ns, ids, source=source)  # type: ignore[arg-type]
            assert x.missing == y.missing == []
            for p, q in zip(x.items, y.items, strict=True):
                assert p is not None
                assert q is not None
                assert (p.group_id, p.policy_version, p.num_tokens, p.prompt_len, p.source) == (
                    q.group_id,
                    q.policy_version,
                    q.num_tokens,
                    q.prompt_len,
                    q.source,
                )
                assert p.routes is not None
                assert q.routes is not None
                assert np.array_equal(p.routes.to_topk(), q.routes.to_topk())
                assert np.array_equal(p.token_ids, q.token_ids)  # type: ignore[arg-type]
        t0 = direct.get_batch(direct_ns, ["t0"]).items[0]
        assert t0 is not None
        assert len(t0.segments) == 2
        assert t0.token_ids is not None
        assert np.array_equal(t0.token_ids[: t0.segments[0].num_tokens], _tokens(40, 0))
        t1 = direct.get_batch(direct_ns, ["t1"]).items[0]
        assert t1 is not None
        assert t1.source == "predicted"
        assert t1.routes is not None
        assert np.array_equal(t1.routes.to_topk(), expected_ids(_content()[1][1]))
        _, fetched_direct = direct.fetch_direct(direct_ns, ids)
        _, fetched_proxied = proxied.fetch_direct(proxied_ns, ids)
        for p, q in zip(fetched_direct.items, fetched_proxied.items, strict=True):
            assert p is not None
            assert q is not None
            assert p.source == q.source
            for s, t in zip(p.segments, q.segments, strict=True):
                assert s.encoded == t.encoded
                assert s.digest == t.digest != b""

        # the direct namespace's rows lie in blobs, each with an index; the proxied one's
        # in Parquet shards
        plan = direct.plan(direct_ns, ids)
        blobs = {o.key for o in plan.objects}
        assert blobs
        assert all(k.endswith(".blob") for k in blobs)
        indexed = {blob_of_index(k) for k in _listed(objects, f"{INDEX_PREFIX}{direct_ns}/")}
        assert blobs <= indexed
        assert _listed(objects, f"{SHARD_PREFIX}{direct_ns}/") == indexed  # no orphan left
        assert all(o.key.endswith(".parquet") for o in proxied.plan(proxied_ns, ids).objects)

        # the same content again: acknowledged, not stored twice; other content: refused
        again = direct.put(direct_ns, _content()[0])
        assert [r.created for r in again] == [False] * 5
        assert [r.digest for r in again] == [
            r.digest for r in direct.put(proxied_ns, _content()[0])
        ]
        other = make_write("other", tokens=40)
        with pytest.raises(Conflict):
            direct.put(direct_ns, [TrajectoryWrite("t0", 40, topk=other.topk)])
        kept = direct.get_batch(direct_ns, ["t0"], decode=False, source="engine").items[0]
        assert kept is not None
        assert [x.digest for x in kept.segments] == [
            next(r.digest for r in results if r.trajectory_id == "t0") for results in acked
        ]


# 2. a writer that crashes between upload and commit


def test_an_upload_never_committed_is_collected_and_its_plan_dies(
    server: ServerProcess, objects: S3Store
) -> None:
    ns = _namespace(server)
    blob, segments = _encoded([make_write("c0"), make_write("c1")])
    with _http(server, KEYS["writer"]) as http:
        plan = _plan(http, ns, expires=10)
        upload = _upload_url(http, ns, plan, len(blob))
        assert upload["headers"] == {"If-None-Match": "*"}
        assert _put(upload, blob) in (200, 201)
        assert _put_blob(http, ns, plan, b"other bytes") == 412  # create-only
        key = _key_of(plan)
        assert key in _listed(objects, f"{SHARD_PREFIX}{ns}/")
        # the writer dies here: nothing is cataloged, nothing readable
        with Client(server.url, api_key=KEYS["reader"]) as reader:
            assert reader.get_batch(ns, ["c0", "c1"]).missing == ["c0", "c1"]
        # while its URL works, the blob is no orphan (it could be uploaded again)
        assert _collect_orphans(server)["orphans_deleted"] == 0
        assert key in _listed(objects, f"{SHARD_PREFIX}{ns}/")
        time.sleep(max(0.0, plan["expires_at"] - time.time()) + 1.5)
        report = _collect_orphans(server)
        assert report["orphans_deleted"] >= 1
        assert key not in _listed(objects, f"{SHARD_PREFIX}{ns}/")
        assert _listed(objects, f"{INDEX_PREFIX}{ns}/") == set()
        late = _commit(http, ns, _body(plan, len(blob), segments))
        assert late.status_code == 400, late.text  # nothing to read any more
        assert _put(upload, blob) == 403  # the URL died before the blob was collected
        gone = http.post(
            f"/v1/namespaces/{ns}/writes/upload", json={"plan": plan["plan"], "size": len(blob)}
        )
        assert gone.status_code == 409, gone.text  # and the plan gives no other
        assert gone.json()["error"]["code"] == "plan_gone"
        with Client(server.url, api_key=KEYS["reader"]) as reader:
            assert reader.get_batch(ns, ["c0", "c1"]).missing == ["c0", "c1"]
        assert _listed(objects, f"{INDEX_PREFIX}{ns}/") == set()
        assert int(http.get(f"/v1/namespaces/{ns}").json()["trajectories"]) == 0


# 3. another key's commit


def test_a_commit_replayed_by_another_key_is_refused(
    server: ServerProcess, objects: S3Store
) -> None:
    ns = _namespace(server)
    blob, segments = _encoded([make_write("k0")])
    with _http(server, KEYS["writer"]) as owner, _http(server, KEYS["admin"]) as thief:
        plan = _plan(owner, ns)
        assert _put_blob(owner, ns, plan, blob) in (200, 201)
        body = _body(plan, len(blob), segments)
        stolen = _commit(thief, ns, body)
        assert stolen.status_code == 403, stolen.text
        assert stolen.json()["error"]["code"] == "forbidden"
        assert _listed(objects, f"{INDEX_PREFIX}{ns}/") == set()
        assert int(owner.get(f"/v1/namespaces/{ns}").json()["trajectories"]) == 0
        mine = _commit(owner, ns, body)
        assert mine.status_code == 200, mine.text
        assert [r["created"] for r in mine.json()["results"]] == [True]
        again = _commit(owner, ns, body)  # the same commit sent again
        assert again.status_code == 200, again.text
        assert [r["created"] for r in again.json()["results"]] == [False]
        assert _commit(thief, ns, body).status_code == 403
    with Client(server.url, api_key=KEYS["reader"]) as reader:
        item = reader.get_batch(ns, ["k0"]).items[0]
        assert item is not None
        assert item.routes is not None
        assert np.array_equal(item.routes.to_topk(), expected_ids(make_write("k0")))


# 4. a revoked key


def test_a_revoked_keys_plan_dies_at_its_expiry(server: ServerProcess, objects: S3Store) -> None:
    ns = _namespace(server)
    made = server.cli("keys", "create", "rollout", "--role", "writer", "--namespace", ns)
    blob, segments = _encoded([make_write("r0")])
    with _http(server, made["key"]) as worker, _http(server, KEYS["admin"]) as admin:
        eventually(  # the server rereads the catalog's keys every 5 s
            lambda: worker.get(f"/v1/namespaces/{ns}").status_code == 200, "the new key taken"
        )
        uploaded = _plan(worker, ns, expires=10)
        unused_plan = _plan(worker, ns, expires=10)
        unused = _upload_url(worker, ns, unused_plan, len(blob))
        assert _put_blob(worker, ns, uploaded, blob) in (200, 201)
        server.cli("keys", "revoke", "rollout")
        eventually(
            lambda: worker.get(f"/v1/namespaces/{ns}").status_code == 401,
            "the revoked key refused",
        )
        refused = _commit(worker, ns, _body(uploaded, len(blob), segments))
        assert refused.status_code in (401, 403), refused.text
        assert worker.post(f"/v1/namespaces/{ns}/writes", json={}).status_code in (401, 403)
        # nor can another key commit the revoked key's plan
        assert _commit(admin, ns, _body(uploaded, len(blob), segments)).status_code == 403
        time.sleep(max(0.0, unused["expires_at"] - time.time()) + 1.5)
        assert _put(unused, blob) == 403  # the store refuses the expired URL
        assert _key_of(unused_plan) not in _listed(objects, f"{SHARD_PREFIX}{ns}/")
        assert _key_of(uploaded) in _listed(objects, f"{SHARD_PREFIX}{ns}/")
        assert int(admin.get(f"/v1/namespaces/{ns}").json()["trajectories"]) == 0
    _collect_orphans(server)
    assert _listed(objects, f"{SHARD_PREFIX}{ns}/") == set()
    assert _listed(objects, f"{INDEX_PREFIX}{ns}/") == set()


# 5. replicas sharing PostgreSQL


@pytest.mark.slow
def test_direct_writes_on_two_replicas(
    tmp_path: Path, seaweed: SeaweedFS, postgres_server: Postgres
) -> None:
    pg_url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    acked: dict[str, tuple[TrajectoryWrite, bytes]] = {}
    outcomes: dict[str, list[object]] = {}
    lock = threading.Lock()
    with replicas(tmp_path, seaweed, pg_url) as (a, b):
        _namespace(a, "ns")
        same = [make_write(f"same{i}") for i in range(8)]
        clash = [
            (
                make_write(f"clash{i}"),
                TrajectoryWrite(f"clash{i}", 30, topk=make_write(f"o{i}", tokens=30).topk),
            )
            for i in range(8)
        ]
        own = {
            "a": [make_write(f"a{i}") for i in range(6)],
            "b": [make_write(f"b{i}") for i in range(6)],
        }

        def put(
            server: ServerProcess, writes: list[TrajectoryWrite], barrier: threading.Barrier | None
        ) -> None:
            with Client(server.url, api_key=KEYS["writer"], direct_writes=True) as client:
                for w in writes:
                    if barrier is not None:
                        barrier.wait(30)
                    try:
                        [result] = client.put("ns", [w])
                    except Conflict as exc:
                        with lock:
                            outcomes.setdefault(w.trajectory_id, []).append(exc)
                        continue
                    with lock:
                        outcomes.setdefault(w.trajectory_id, []).append(result.created)
                        acked[w.trajectory_id] = (w, result.digest)

        barrier = threading.Barrier(2)
        threads = [
            threading.Thread(target=put, args=(a, [*same, *(x for x, _ in clash)], barrier)),
            threading.Thread(target=put, args=(b, [*same, *(y for _, y in clash)], barrier)),
            threading.Thread(target=put, args=(a, own["a"], None)),
            threading.Thread(target=put, args=(b, own["b"], None)),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        for w in same:
            assert sorted(outcomes[w.trajectory_id]) == [False, True], outcomes  # type: ignore[type-var]
        for x, _y in clash:
            got = outcomes[x.trajectory_id]
            assert len(got) == 2
            assert sum(isinstance(o, Conflict) for o in got) == 1, got
            assert [o for o in got if not isinstance(o, Conflict)] == [True]
        for w in own["a"] + own["b"]:
            assert outcomes[w.trajectory_id] == [True]
        ids = sorted(acked)
        assert len(ids) == 8 + 8 + 12
        seen: dict[str, list[bytes]] = {}
        for server in (a, b):
            with Client(server.url, api_key=KEYS["reader"]) as reader:
                batch = reader.get_batch("ns", ids, decode=False)
                assert batch.missing == []
                for tid, item in zip(ids, batch.items, strict=True):
                    assert item is not None
                    assert [s.digest for s in item.segments] == [acked[tid][1]]
                    seen.setdefault(tid, []).append(item.segments[0].digest)
                decoded = reader.get_batch("ns", ids)
                for tid, item in zip(ids, decoded.items, strict=True):
                    assert item is not None
                    assert item.routes is not None
                    assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid][0]))
        store = seaweed.new_store(prefix=a.prefix)
        try:
            assert all(k.endswith(".blob") for k in _listed(store, f"{SHARD_PREFIX}ns/"))
            fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
            try:
                report = rebuild_catalog(store, fresh)
                assert report.skipped == []
                assert report.trajectories == len(ids), report
                found = fresh.segments.lookup("ns", ids)
                assert {tid: [e.digest for e in es] for tid, es in found.items()} == {
                    tid: [acked[tid][1]] for tid in ids
                }
                rebuilt = Engine(store, fresh)
                batch = rebuilt.get_batch("ns", ids)
                assert batch.missing == []
                for tid, item in zip(ids, batch.items, strict=True):
                    assert item is not None
                    assert item.routes is not None
                    assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid][0]))
            finally:
                fresh.close()
        finally:
            store.close()


def test_a_commit_that_loses_a_race_leaves_no_index(tmp_path: Path, seaweed: SeaweedFS) -> None:
    """Two replicas (engines on one catalog) commit other content for one id at once:
    the one that loses after writing its index is refused, and neither its rows nor
    the content that lost come back in a rebuild."""
    url = f"sqlite:///{tmp_path / 'catalog.db'}"
    prefix = f"t-{uuid.uuid4().hex[:16]}"
    mine_store, theirs_store = seaweed.new_store(prefix=prefix), seaweed.new_store(prefix=prefix)
    mine, theirs = Engine(mine_store, Catalog(url)), Engine(theirs_store, Catalog(url))
    try:
        mine.namespaces.create("ns", SPEC)
        their_write = TrajectoryWrite("x", 25, topk=make_write("z", tokens=25).topk)
        their_blob, their_segments = _encoded([their_write])
        their_plan = theirs.direct.plan("ns", "w", 600)  # planned first: the older blob
        assert _put_planned(theirs, their_plan, their_blob) in (200, 201)
        time.sleep(0.01)
        blob, segments = _encoded([make_write("x"), make_write("y")])
        plan = mine.direct.plan("ns", "w", 600)
        assert _put_planned(mine, plan, blob) in (200, 201)
        real = mine_store.put_if_absent
        raced: list[list[PutResult]] = []

        def before_index(key: str, data: bytes | memoryview) -> None:
            if key.startswith(INDEX_PREFIX) and not raced:  # the other replica wins meanwhile
                raced.append(
                    theirs.direct.commit(
                        "ns", their_plan.plan, len(their_blob), their_segments, "w"
                    )
                )
            real(key, data)

        mine_store.put_if_absent = before_index  # type: ignore[method-assign]
        with pytest.raises(Conflict):
            mine.direct.commit("ns", plan.plan, len(blob), segments, "w")
        assert raced
        assert raced[0][0].created
        assert mine.get_batch("ns", ["x", "y"]).missing == ["y"]
        blob_key = _key_of({"plan": plan.plan})
        indexed = {blob_of_index(k) for k in _listed(mine_store, INDEX_PREFIX)}
        assert blob_key not in indexed, "a refused commit's index would bring its rows back"
        fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
        try:
            rebuild_catalog(theirs_store, fresh)
            found = fresh.segments.lookup("ns", ["x", "y"])
            assert set(found) == {"x"}
            assert [e.digest for e in found["x"]] == [raced[0][0].digest]
        finally:
            fresh.close()
    finally:
        mine.close()
        theirs.close()
        mine_store.close()
        theirs_store.close()


Staged = tuple[WritePlan, bytes, list[DirectSegment]]


def _staged(engine: Engine, writes: list[TrajectoryWrite]) -> list[Staged]:
    """Each write uploaded in a blob of its own, with a plan of its own, not committed."""
    staged = []
    for write in writes:
        blob, segments = _encoded([write])
        plan = engine.direct.plan("ns", "w", 600)
        assert _put_planned(engine, plan, blob) in (200, 201)
        staged.append((plan, blob, segments))
    return staged


def _commit_behind_a_slow_one(
    engine: Engine, catalog: Catalog, staged: list[Staged]
) -> tuple[dict[int, Any], list[int]]:
    """Commit `staged[0]`, then all the others at once while its transaction is slowed,
    so that they arrive together: each commit's answer (or error), and the number of
    blobs of each transaction the catalog was asked for."""
    real = catalog.shards.commit_many
    groups: list[int] = []

    def slow(stored: Any) -> None:
        groups.append(len(stored))
        time.sleep(0.3 if len(groups) == 1 else 0)  # the others arrive meanwhile
        real(stored)

    catalog.shards.commit_many = slow  # type: ignore[method-assign]
    answers: dict[int, Any] = {}

    def commit(i: int) -> None:
        plan, blob, segments = staged[i]
        try:
            answers[i] = engine.direct.commit("ns", plan.plan, len(blob), segments, "w")
        except R3StoreError as exc:
            answers[i] = exc

    first = threading.Thread(target=commit, args=(0,))
    first.start()
    time.sleep(0.1)  # the first commit is under way
    others = [threading.Thread(target=commit, args=(i,)) for i in range(1, len(staged))]
    for thread in others:
        thread.start()
    for thread in [first, *others]:
        thread.join()
    return answers, groups


def test_commits_that_arrive_together_share_one_transaction(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    """Eight commits at once while the catalog is slow: they commit in fewer
    transactions than commits, each answers its own rows, and one whose plan was
    collected meanwhile is refused alone (the rest of its group committed, its
    index gone, so a rebuild finds exactly the seven)."""
    store = seaweed.new_store(prefix=f"t-{uuid.uuid4().hex[:16]}")
    catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    engine = Engine(store, catalog)
    try:
        engine.namespaces.create("ns", SPEC)
        writes = [make_write(f"g{i}") for i in range(8)]
        staged = _staged(engine, writes)
        gone = engine.direct.check_plan("ns", staged[5][0].plan, "w")
        assert catalog.ledger.claim_orphan(gone, time.time() + 3600)  # planned to expiry
        answers, groups = _commit_behind_a_slow_one(engine, catalog, staged)
        assert isinstance(answers[5], PlanGone)
        for i in set(range(8)) - {5}:
            assert [(r.trajectory_id, r.created) for r in answers[i]] == [(f"g{i}", True)]
        assert max(groups) >= 3, groups  # a group of several blobs, refused for one of them
        assert len([g for g in groups if g > 1]) < len(groups)  # and the rest retried alone
        batch = engine.get_batch("ns", [w.trajectory_id for w in writes])
        assert batch.missing == ["g5"]
        for i, (write, item) in enumerate(zip(writes, batch.items, strict=True)):
            if i == 5:
                continue
            assert item is not None
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), expected_ids(write))
        fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
        try:
            rebuild_catalog(store, fresh)
            assert set(fresh.segments.lookup("ns", [w.trajectory_id for w in writes])) == {
                f"g{i}" for i in range(8) if i != 5
            }
        finally:
            fresh.close()
    finally:
        engine.close()
        store.close()


def test_a_group_whose_index_cannot_be_written_leaves_no_index(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    """Commits grouped behind a slow one, the store refusing the group's second index:
    nothing of the group is committed, each commit says so, none of its indexes stays
    (a rebuild would bring back rows never acknowledged), and each commits when sent
    again."""
    store = seaweed.new_store(prefix=f"t-{uuid.uuid4().hex[:16]}")
    catalog = Catalog(f"sqlite:///{tmp_path / 'catalog.db'}")
    engine = Engine(store, catalog)
    try:
        engine.namespaces.create("ns", SPEC)
        staged = _staged(engine, [make_write(f"i{i}") for i in range(4)])
        real_put = store.put_if_absent
        indexes: list[str] = []

        def failing(key: str, data: bytes | memoryview) -> None:
            if key.startswith(INDEX_PREFIX):
                indexes.append(key)
                if len(indexes) == 3:  # the grouped commit's second index
                    raise StoreError("the store refused the write")
            real_put(key, data)

        store.put_if_absent = failing  # type: ignore[method-assign]
        answers, groups = _commit_behind_a_slow_one(engine, catalog, staged)
        assert groups == [1], groups  # the group never reached the catalog
        assert answers[0][0].created
        assert all(isinstance(answers[i], StoreError) for i in (1, 2, 3)), answers
        left = _listed(store, INDEX_PREFIX)
        assert left == {indexes[0]}, "the group's indexes name rows never committed"
        assert engine.get_batch("ns", ["i1", "i2", "i3"]).missing == ["i1", "i2", "i3"]
        for i in (1, 2, 3):
            plan, blob, segments = staged[i]
            assert engine.direct.commit("ns", plan.plan, len(blob), segments, "w")[0].created
    finally:
        engine.close()
        store.close()


# 6. hostile commits


def test_hostile_commits_are_refused_and_change_nothing(
    server: ServerProcess, objects: S3Store
) -> None:
    ns, elsewhere = _namespace(server), _namespace(server)
    short, long = (
        TrajectoryWrite(
            w.trajectory_id, w.num_tokens, topk=w.topk, token_ids=_tokens(w.num_tokens, 7)
        )
        for w in (make_write("h0", tokens=30), make_write("h1", tokens=90))
    )
    blob, segments = _encoded([short, long])
    with _http(server, KEYS["writer"]) as http:
        plan = _plan(http, ns)
        assert _put_blob(http, ns, plan, blob) in (200, 201)
        good = _body(plan, len(blob), segments)

        def refused(body: dict[str, Any], into: str = ns, status: int = 400) -> str:
            r = _commit(http, into, body)
            assert r.status_code == status, r.text
            return str(r.json()["error"]["message"])

        # the token forged or altered
        token = plan["plan"]
        payload, mac = token.split(".")
        flipped = payload[:-2] + ("A" if payload[-2] != "A" else "B") + payload[-1]
        for forged in (f"{flipped}.{mac}", f"{payload}.{mac[::-1]}", "x", "a.b"):
            assert "not a write plan" in refused({**good, "plan": forged})
        # a plan of another namespace, sent to this one, and this one's sent there
        other = _plan(http, elsewhere)
        assert _put_blob(http, elsewhere, other, blob) in (200, 201)
        refused(_body(other, len(blob), segments))
        refused(good, into=elsewhere)
        # spans past the end of the blob
        past = [
            segments[0],
            segments[1].model_copy(
                update={"route_ids": SpanModel(offset=len(blob) - 4, length=64)}
            ),
        ]
        assert "past the end" in refused(_body(plan, len(blob), past))
        # a size other than the blob's
        refused({**good, "size": len(blob) + 1})
        refused({**good, "size": len(blob) - 1})
        # a plan nothing was uploaded with
        assert "nothing was uploaded" in refused(_body(_plan(http, ns), len(blob), segments))
        # truncated streams
        cut = segments[1].route_ids.model_copy(update={"length": segments[1].route_ids.length - 5})
        refused(
            _body(plan, len(blob), [segments[0], segments[1].model_copy(update={"route_ids": cut})])
        )
        # streams swapped between the two segments
        swapped = [
            segments[0].model_copy(update={"route_ids": segments[1].route_ids}),
            segments[1].model_copy(update={"route_ids": segments[0].route_ids}),
        ]
        refused(_body(plan, len(blob), swapped))
        tokens = [
            segments[0].model_copy(update={"token_ids": segments[1].token_ids}),
            segments[1].model_copy(update={"token_ids": segments[0].token_ids}),
        ]
        assert segments[0].token_ids is not None
        refused(_body(plan, len(blob), tokens))
        # a segment that says it has other tokens than its streams hold
        refused(
            _body(plan, len(blob), [segments[0].model_copy(update={"num_tokens": 31}), segments[1]])
        )
        # frames that are not zstd at all
        junk = np.random.default_rng(0).integers(0, 256, 4096, dtype=np.uint8).tobytes()
        junk_plan = _plan(http, ns)
        assert _put_blob(http, ns, junk_plan, junk) in (200, 201)
        junk_segments = [
            segments[0].model_copy(
                update={
                    "route_ids": SpanModel(offset=0, length=1000),
                    "route_counts": None,
                    "route_order": None,
                    "token_ids": SpanModel(offset=1000, length=100),
                }
            )
        ]
        refused(_body(junk_plan, len(junk), junk_segments))
        # the blob's bytes, but a zstd frame cut short inside it
        frame = segments[0].route_ids
        clipped = SpanModel(offset=frame.offset, length=max(1, frame.length // 2))
        refused(_body(plan, len(blob), [segments[0].model_copy(update={"route_ids": clipped})]))

        # nothing of these is cataloged, indexed or readable
        assert _listed(objects, f"{INDEX_PREFIX}{ns}/") == set()
        assert _listed(objects, f"{INDEX_PREFIX}{elsewhere}/") == set()
        for space in (ns, elsewhere):
            assert int(http.get(f"/v1/namespaces/{space}").json()["trajectories"]) == 0
        # and the honest commit of the same plan still goes through
        r = _commit(http, ns, good)
        assert r.status_code == 200, r.text
        assert [x["created"] for x in r.json()["results"]] == [True, True]
    with Client(server.url, api_key=KEYS["reader"]) as reader:
        batch = reader.get_batch(ns, ["h0", "h1"])
        for write, item in zip((short, long), batch.items, strict=True):
            assert item is not None
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), expected_ids(write))
    assert len(_listed(objects, f"{INDEX_PREFIX}{ns}/")) == 1


# 7. the embedded store


def test_the_embedded_store_takes_writes_through_the_server(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = ServerProcess(tmp_path, None)
    try:
        with (
            Client(server.url, api_key=KEYS["admin"]) as client,
            caplog.at_level(logging.INFO, logger="r3store_client"),
        ):
            client.create_namespace("local", SPEC)
            [result] = client.put("local", [make_write("l0")])
            assert result.created
            assert "writes go through the server" in caplog.text
            assert "direct writes need an object store that signs URLs" in caplog.text
            [again] = client.put("local", [make_write("l1")])  # no second plan asked
            assert again.created
            assert caplog.text.count("writes go through the server") == 1
            item = client.get_batch("local", ["l0"]).items[0]
            assert item is not None
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), expected_ids(make_write("l0")))
        with Client(server.url, api_key=KEYS["admin"], direct_writes=True) as insisting:
            with pytest.raises(DirectUnavailable):
                insisting.put("local", [make_write("l2")])
            assert insisting.get_batch("local", ["l2"]).missing == ["l2"]
    finally:
        server.stop()


# the namespace's dictionary


def _routed(seed: int, count: int, tokens: int) -> list[TrajectoryWrite]:
    """Trajectories whose routes follow from their tokens (one of 512), as a trained
    router's do: what compression at rest learns a dictionary from."""
    rng = np.random.default_rng(seed)
    router = skewed_topk(
        np.random.default_rng(0), 512, SPEC.num_layers, SPEC.num_experts, SPEC.top_k
    )
    return [
        TrajectoryWrite(f"d{seed}-{i}", tokens, topk=router[rng.integers(0, 512, tokens)])
        for i in range(count)
    ]


def test_direct_writes_encode_with_the_namespace_dictionary(
    server: ServerProcess, objects: S3Store
) -> None:
    ns = _namespace(server)
    with Client(server.url, api_key=KEYS["admin"]) as client:
        first = _routed(1, 96, 800)  # 1.2 MB of ids: enough to train a dictionary from
        for begin in range(0, len(first), 16):
            client.put(ns, first[begin : begin + 16])
        with _http(server, KEYS["writer"]) as http:
            assert _plan(http, ns)["dictionary"] is None  # none made yet
            assert server.cli("maintain", "--cold-age", "0")["dictionaries_trained"] == 1
            [key] = _listed(objects, f"{DICTIONARY_PREFIX}{ns}/")
            digest = key.rsplit("/", 1)[1].removesuffix(".zdict")
            planned = _plan(http, ns)["dictionary"]
            assert planned is not None
            assert planned["digest"] == digest
            assert httpx.get(planned["url"], timeout=30).content == objects.get(key)

            indexes = _listed(objects, f"{INDEX_PREFIX}{ns}/")
            later = _routed(2, 8, 400)
            with Client(server.url, api_key=KEYS["admin"]) as fresh:  # a new worker
                results = fresh.put(ns, later)
            assert all(r.created for r in results)
            [index] = _listed(objects, f"{INDEX_PREFIX}{ns}/") - indexes
            rows = json.loads(objects.get(index))["rows"]
            assert {(r["route_dictionary"], r["route_transform"]) for r in rows} == {(digest, 2)}
            ids = [w.trajectory_id for w in later]
            for batch in (client.get_batch(ns, ids), client.fetch_direct(ns, ids)[1]):
                assert batch.missing == []
            decoded = client.get_batch(ns, ids)
            for write, item in zip(later, decoded.items, strict=True):
                assert item is not None
                assert item.routes is not None
                assert np.array_equal(item.routes.to_topk(), np.sort(write.topk, axis=-1))

            # a commit naming a dictionary the namespace does not have changes nothing
            encoded = [encode_write(w, SPEC) for w in _routed(3, 1, 50)]
            blob, segments = pack(encoded)
            plan = _plan(http, ns)
            assert _put_blob(http, ns, plan, blob) in (200, 201)
            named = [segments[0].model_copy(update={"route_dictionary": "ab" * 16})]
            refused = _commit(http, ns, _body(plan, len(blob), named))
            assert refused.status_code == 409, refused.text  # the client plans again
            assert refused.json()["error"]["code"] == "plan_gone"
            assert "does not have" in refused.json()["error"]["message"]
            assert client.get_batch(ns, ["d3-0"]).missing == ["d3-0"]


def test_commits_that_cannot_be_held_hold_no_memory(server: ServerProcess) -> None:
    """A forged plan is refused before any of the upload memory is held, a blob larger
    than a commit can ever hold is refused at once (413, and plans say so), and
    overlapping spans are refused: the honest commit after many of each still goes."""
    ns = _namespace(server)
    blob, segments = _encoded([make_write("m0"), make_write("m1")])
    with _http(server, KEYS["writer"]) as http:
        plan = _plan(http, ns)
        assert _put_blob(http, ns, plan, blob) in (200, 201)
        huge = 200 << 20
        for _ in range(8):  # each would hold 3x its size were it admitted first
            forged = _commit(http, ns, {**_body(plan, huge, segments), "plan": "x.y"})
            assert forged.status_code == 400, forged.text
        too_big = _commit(http, ns, _body(plan, huge, segments))
        assert too_big.status_code == 413, too_big.text
        assert plan["max_bytes"] < huge
        whole = SpanModel(offset=0, length=len(blob))  # every segment names every byte
        overlapping = [s.model_copy(update={"route_ids": whole}) for s in segments]
        doubled = _commit(http, ns, _body(plan, len(blob), overlapping))
        assert doubled.status_code == 400, doubled.text
        assert "overlap" in doubled.json()["error"]["message"]
        done = _commit(http, ns, _body(plan, len(blob), segments))
        assert done.status_code == 200, done.text
        # bytes no segment names: not kept in a committed blob
        padded = _plan(http, ns)
        assert _put_blob(http, ns, padded, blob + b"\0" * 4096) in (200, 201)
        junk = _commit(http, ns, _body(padded, len(blob) + 4096, segments))
        assert junk.status_code == 400, junk.text
        assert "every byte of a blob belongs to one stream" in junk.json()["error"]["message"]


def test_a_plan_stores_its_blob_and_nothing_larger(server: ServerProcess, objects: S3Store) -> None:
    """A plan carries no URL; the URL asked for once the blob is encoded writes exactly
    that many bytes (a larger or a smaller body, or a chunked one, is refused by the
    store and nothing is kept), no more than a commit may take, for the plan's key
    only."""
    ns = _namespace(server)
    blob, segments = _encoded([make_write("s0")])
    with _http(server, KEYS["writer"]) as http, _http(server, KEYS["admin"]) as other:
        plan = _plan(http, ns)
        assert set(plan) == {"plan", "expires_at", "max_bytes", "dictionary"}
        upload = _upload_url(http, ns, plan, len(blob))
        assert upload["expires_at"] == plan["expires_at"]
        key = _key_of(plan)
        for body in (blob + bytes(1 << 20), blob[:-1], blob + b"\0"):
            assert _put(upload, body) == 403
        chunked = httpx.put(upload["url"], content=iter([blob]), headers=upload["headers"])
        assert chunked.status_code == 403
        assert key not in _listed(objects, f"{SHARD_PREFIX}{ns}/")

        def asked(client: httpx.Client, size: int) -> httpx.Response:
            body = {"plan": plan["plan"], "size": size}
            return client.post(f"/v1/namespaces/{ns}/writes/upload", json=body)

        too_big = asked(http, plan["max_bytes"] + 1)
        assert too_big.status_code == 413, too_big.text
        assert asked(other, len(blob)).status_code == 403  # another key's plan
        assert asked(http, 0).status_code == 422
        assert _put(upload, blob) in (200, 201)
        assert _put_blob(http, ns, plan, blob) == 412  # a second URL: the key is taken
        done = _commit(http, ns, _body(plan, len(blob), segments))
        assert done.status_code == 200, done.text
        assert len(objects.get(key)) == len(blob)
        # a plan no longer planned gives no URL: committed, or its namespace deleted
        again = asked(http, len(blob))
        assert again.status_code == 409, again.text
        assert again.json()["error"]["code"] == "plan_gone"
        unused = _plan(http, ns)
        assert other.delete(f"/v1/namespaces/{ns}").status_code in (200, 204)
        body = {"plan": unused["plan"], "size": len(blob)}
        gone = http.post(f"/v1/namespaces/{ns}/writes/upload", json=body)
        assert gone.status_code == 409, gone.text
        assert _key_of(unused) not in _listed(objects, f"{SHARD_PREFIX}{ns}/")


def test_one_key_holds_a_bounded_number_of_write_plans(tmp_path: Path, seaweed: SeaweedFS) -> None:
    """Plans not committed and not expired are bounded per API key
    (`R3STORE_MAX_PLANS_PER_KEY`): one more is 429, a commit's next plans are cut to
    what is left, and another key plans as before."""
    server = ServerProcess(tmp_path, seaweed, env={"R3STORE_MAX_PLANS_PER_KEY": "4"})
    try:
        ns = _namespace(server)
        blob, segments = _encoded([make_write("p0")])
        with _http(server, KEYS["writer"]) as http, _http(server, KEYS["admin"]) as admin:
            plans = [_plan(http, ns) for _ in range(4)]
            refused = http.post(f"/v1/namespaces/{ns}/writes", json={})
            assert refused.status_code == 429, refused.text
            assert "R3STORE_MAX_PLANS_PER_KEY" in refused.json()["error"]["message"]
            assert _plan(admin, ns)["plan"]  # another key's own share
            assert _put_blob(http, ns, plans[0], blob) in (200, 201)
            done = _commit(http, ns, {**_body(plans[0], len(blob), segments), "next_plans": 8})
            assert done.status_code == 200, done.text
            assert len(done.json()["next"]) == 1  # three still held, one more allowed
            again = http.post(f"/v1/namespaces/{ns}/writes", json={})
            assert again.status_code == 429, again.text
    finally:
        server.stop()


def test_replicas_planning_for_one_key_at_once_keep_its_bound(
    seaweed: SeaweedFS, postgres_server: Postgres
) -> None:
    """Plan requests of one API key on two replicas sharing a PostgreSQL catalog, all
    at once: no more plans are made than the key may hold."""
    url = postgres_server.database(f"r3_{uuid.uuid4().hex[:12]}")
    prefix = f"t-{uuid.uuid4().hex[:16]}"
    replicas = [Engine(seaweed.new_store(prefix), Catalog(url)) for _ in range(2)]
    replicas[0].namespaces.create("ns", SPEC)
    start = threading.Barrier(16)
    made: list[int] = []

    def ask(engine: Engine) -> None:
        start.wait()
        made.append(len(engine.direct.plans("ns", "w", 600, 2, most=5)))

    threads = [threading.Thread(target=ask, args=(replicas[i % 2],)) for i in range(16)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sum(made) == 5, made
        assert len(replicas[1].direct.plans("ns", "other", 600, 2, most=5)) == 2
    finally:
        for engine in replicas:
            engine.close()


def test_a_commit_is_charged_what_checking_its_segments_decodes(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    """A blob of a few kB whose segment decodes to 64 MiB: checking it would hold three
    times that, more than one commit may ever hold of this budget (128 MiB), so it is
    refused before anything is decompressed, however small the blob."""
    from r3store.protocol.direct import pack
    from r3store.spec import RouteSpec
    from r3store.testing.synthetic import decode_bomb

    env = {
        "R3STORE_MAX_BODY_BYTES": str(16 << 20),
        "R3STORE_UPLOAD_MEMORY_BYTES": str(128 << 20),
        "R3STORE_UPLOAD_MEMORY_PER_KEY": str(128 << 20),
    }
    server = ServerProcess(tmp_path, seaweed, env=env)
    try:
        with Client(server.url, api_key=KEYS["admin"]) as admin:
            admin.create_namespace("large", RouteSpec(num_layers=48, num_experts=128, top_k=8))
        blob, segments = pack(decode_bomb("bomb", 1))
        assert len(blob) < 64 << 10
        with _http(server, KEYS["writer"]) as http:
            plan = _plan(http, "large")
            assert _put_blob(http, "large", plan, blob) in (200, 201)
            refused = _commit(http, "large", _body(plan, len(blob), segments))
            assert refused.status_code == 413, refused.text
            assert "to check the largest encoded segment" in refused.json()["error"]["message"]
    finally:
        server.stop()
