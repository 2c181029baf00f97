"""The HTTP service through real HTTP semantics (ASGI), on a real S3 server."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from helpers import SPEC, expected_ids, make_write
from http_helpers import AppClient, auth, make_namespace, read, service, stored_state, upload
from r3store.engine import Engine
from r3store.logic.routes import to_mask
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.seaweedfs import SeaweedFS


@pytest.fixture
def client(tmp_path: Path, seaweed: SeaweedFS) -> Iterator[AppClient]:
    with service(tmp_path, seaweed) as made:
        make_namespace(made)
        yield made


@pytest.mark.parametrize("fmt", ["encoded", "ids", "mask"])
@pytest.mark.parametrize("ordered", [False, True])
def test_round_trip_ids_and_masks(
    tmp_path: Path, seaweed: SeaweedFS, fmt: str, ordered: bool
) -> None:
    spec = RouteSpec(4, 64, 4, ordered=ordered)
    with service(tmp_path, seaweed) as client:
        make_namespace(client, ordered=ordered)
        writes = [make_write(f"t{i}", spec, group_id="g", policy_version=1) for i in range(4)]
        if not ordered:  # masks are sets: only unordered namespaces take them
            routes = Engine.prepare_routes(spec, make_write("m", spec))
            writes.append(TrajectoryWrite("m", routes.num_tokens, mask=to_mask(routes, spec)[:-1]))
        response = upload(client, writes)
        assert response.status_code == 200, response.text
        assert all(r["created"] for r in response.json()["results"])
        if fmt == "mask" and ordered:
            return
        ids = [w.trajectory_id for w in reversed(writes)]
        batch = read(client, ids, format=fmt)
        assert batch.ids == ids
        for tid, item in zip(ids, batch.items, strict=True):
            write = next(w for w in writes if w.trajectory_id == tid)
            if write.topk is not None:
                want = expected_ids(write, spec if fmt != "mask" else RouteSpec(4, 64, 4))
                assert np.array_equal(item.routes.to_topk(), want)
            assert item.num_tokens == write.num_tokens


def test_idempotent_retry_and_conflict(client: AppClient) -> None:
    first = make_write("a")
    assert upload(client, [first]).json()["results"][0]["created"] is True
    again = upload(client, [first])
    assert again.status_code == 200
    assert again.json()["results"][0]["created"] is False
    other = make_write("b")
    clash = upload(client, [TrajectoryWrite("a", other.num_tokens, topk=other.topk)])
    assert clash.status_code == 409
    assert clash.json()["error"]["code"] == "conflict"
    assert stored_state(client)[0] == 1


def test_multi_turn_append_over_http(client: AppClient) -> None:
    turn1 = make_write("chat", tokens=30, group_id="g", policy_version=1)
    turn2 = make_write("chat-2", tokens=12)
    appended = TrajectoryWrite("chat", 12, topk=turn2.topk, start=30, policy_version=2)
    assert upload(client, [turn1]).status_code == 200
    assert upload(client, [appended]).status_code == 200
    item = read(client, ["chat"]).items[0]
    assert item.num_tokens == 42
    assert [(s.start, s.policy_version) for s in item.segments] == [(0, 1), (30, 2)]
    want = np.concatenate([expected_ids(turn1), expected_ids(turn2)])
    assert np.array_equal(item.routes.to_topk(), want)
    gap = TrajectoryWrite("chat", 12, topk=turn2.topk, start=50)
    response = upload(client, [gap])
    assert response.status_code == 400
    assert "token 42" in response.json()["error"]["message"]


def test_staleness_over_http(client: AppClient) -> None:
    settings = {"max_policy_lag": 1}
    assert (
        client.put("/v1/namespaces/ns/settings", json=settings, headers=auth("admin")).status_code
        == 200
    )
    assert upload(client, [make_write("old", policy_version=0)]).status_code == 200
    r = client.put(
        "/v1/namespaces/ns/policy-version", json={"policy_version": 3}, headers=auth("trainer")
    )
    assert r.status_code == 200
    assert r.json()["policy_version"] == 3
    refused = upload(client, [make_write("older", policy_version=1)])
    assert refused.status_code == 409
    assert refused.json()["error"]["code"] == "stale_policy"
    batch = read(client, ["old", "nope"])
    assert batch.stale == ["old"]
    assert batch.missing == ["nope"]
    assert batch.items == [None, None]
    assert read(client, ["old"], include_stale=True).items[0] is not None
    back = client.put(
        "/v1/namespaces/ns/policy-version", json={"policy_version": 2}, headers=auth("trainer")
    )
    assert back.status_code == 400


def sample(client: AppClient, **body: object) -> list[str]:
    r = client.post("/v1/namespaces/ns/routes/sample", json=body, headers=auth("reader"))
    assert r.status_code == 200, r.text
    from r3store.protocol.wire import decode_batch

    return decode_batch(r.content, decode=False)[1].ids


def test_sampling_semantics(client: AppClient) -> None:
    client.put("/v1/namespaces/ns/settings", json={"max_times_sampled": 1}, headers=auth("admin"))
    for i in range(6):  # one upload each: a known commit order
        upload(client, [make_write(f"f{i}", group_id=f"g{i // 2}")])
    assert sample(client, n=2) == ["f0", "f1"]
    assert sample(client, n=3, whole_groups=True) == ["f2", "f3"]
    assert sample(client, n=5) == ["f4", "f5"]
    assert sample(client, n=5) == []


def test_uniform_sampling_over_http(client: AppClient) -> None:
    upload(client, [make_write(f"u{i}") for i in range(8)])
    counts: collections.Counter[str] = collections.Counter()
    for seed in range(160):
        counts.update(sample(client, n=2, strategy="uniform", seed=seed))
    # 320 draws over 8 ids: 40 expected each, 4 sigma is about +-24
    assert set(counts) == {f"u{i}" for i in range(8)}
    assert all(16 <= c <= 64 for c in counts.values()), counts


def bad_bodies() -> list[tuple[str, bytes, str, int, str]]:
    good = make_write("x")
    wrong_spec = make_write("y", RouteSpec(4, 64, 2))
    routes = Engine.prepare_routes(SPEC, good)
    mask = to_mask(routes, SPEC)[:-1].copy()
    mask[3, 1] = 0b111
    out_of_range = np.asarray(good.topk).copy()
    out_of_range[2, 0, 0] = 99
    whole = encode_writes([good])
    return [
        ("truncated", whole[: len(whole) // 2], CONTENT_TYPE, 400, "invalid_input"),
        ("json", b'{"routes": [1, 2, 3]}', "application/json", 415, "unsupported_media_type"),
        ("garbage", b"\x00" * 100, CONTENT_TYPE, 400, "invalid_input"),
        ("wrong spec", encode_writes([wrong_spec]), CONTENT_TYPE, 400, "invalid_routes"),
        (
            "bad mask",
            encode_writes([TrajectoryWrite("m", good.num_tokens, mask=mask)]),
            CONTENT_TYPE,
            400,
            "invalid_routes",
        ),
        (
            "out of range",
            encode_writes([TrajectoryWrite("o", good.num_tokens, topk=out_of_range)]),
            CONTENT_TYPE,
            400,
            "invalid_routes",
        ),
        (
            "bad id",
            encode_writes([TrajectoryWrite("a\nb", good.num_tokens, topk=good.topk)]),
            CONTENT_TYPE,
            400,
            "invalid_input",
        ),
        (
            "rows",
            encode_writes([TrajectoryWrite("r", good.num_tokens + 5, topk=good.topk)]),
            CONTENT_TYPE,
            400,
            "invalid_routes",
        ),
    ]


@pytest.mark.parametrize(
    ("name", "body", "media", "status", "code"), bad_bodies(), ids=[b[0] for b in bad_bodies()]
)
def test_bad_uploads_change_nothing(
    client: AppClient, name: str, body: bytes, media: str, status: int, code: str
) -> None:
    upload(client, [make_write("keep")])
    before = stored_state(client)
    r = client.post(
        "/v1/namespaces/ns/trajectories",
        content=body,
        headers={**auth("writer"), "Content-Type": media},
    )
    assert r.status_code == status, r.text
    assert r.json()["error"]["code"] == code
    assert r.json()["error"]["message"]
    assert "Traceback" not in r.text
    assert stored_state(client) == before


def test_oversized_body_and_unknown_namespace(tmp_path: Path, seaweed: SeaweedFS) -> None:
    with service(tmp_path, seaweed, max_body_bytes=4096) as client:
        make_namespace(client)
        big = encode_writes([make_write("big", tokens=500)])
        assert len(big) > 4096
        r = client.post(
            "/v1/namespaces/ns/trajectories",
            content=big,
            headers={**auth("writer"), "Content-Type": CONTENT_TYPE},
        )
        assert r.status_code == 413
        assert r.json()["error"]["code"] == "payload_too_large"
        assert stored_state(client)[0] == 0
        r = upload(client, [make_write("x", tokens=5)], ns="nowhere", role="admin")
        assert r.status_code == 404
        r = client.post("/v1/namespaces/ns/routes/batch", json={"ids": []}, headers=auth("reader"))
        assert r.status_code == 422
        r = client.post(
            "/v1/namespaces/ns/routes/batch", json={"ids": ["a\x01"]}, headers=auth("reader")
        )
        assert r.status_code == 400
        r = client.post(
            "/v1/namespaces",
            json={"name": "bad name", "spec": {"num_layers": 1, "num_experts": 8, "top_k": 2}},
            headers=auth("admin"),
        )
        assert r.status_code == 422
        r = client.post(
            "/v1/namespaces",
            json={"name": "ok", "spec": {"num_layers": 1, "num_experts": 8, "top_k": 9}},
            headers=auth("admin"),
        )
        assert r.status_code == 400


def test_namespace_lifecycle_and_operations(client: AppClient) -> None:
    again = client.post(
        "/v1/namespaces",
        json={"name": "ns", "spec": {"num_layers": 4, "num_experts": 64, "top_k": 2}},
        headers=auth("admin"),
    )
    assert again.status_code == 409
    listed = client.get("/v1/namespaces", headers=auth("reader")).json()
    assert [n["name"] for n in listed["namespaces"]] == ["ns"]
    upload(client, [make_write("t")])
    r = client.get("/healthz")
    assert r.json() == {"status": "ok", "detail": None}
    assert client.get("/readyz").json()["status"] == "ready"
    r = client.get("/metrics", headers={**auth("admin"), "X-Request-ID": "trace-me"})
    assert r.headers["X-Request-ID"] == "trace-me"
    text = r.text
    assert (
        'r3store_http_requests_total{method="POST",route="/v1/namespaces/{namespace}/trajectories",status="200"}'
        in text
    )
    assert "r3store_token_layers_in_total" in text
    assert "r3store_write_buffer_fill" in text
    assert client.delete("/v1/namespaces/ns", headers=auth("admin")).json()["objects_deleted"] >= 2
    assert client.get("/v1/namespaces/ns", headers=auth("admin")).status_code == 404
    assert client.get("/openapi.json").status_code == 200


def test_maintenance_metrics_exported(client: AppClient) -> None:
    upload(client, [make_write("m")])
    text = client.get("/metrics", headers=auth("admin")).text
    assert "r3store_live_route_bytes" in text
    assert "r3store_compactions_total" in text
