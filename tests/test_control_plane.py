"""The JSON control plane refuses what the catalog cannot hold, never coerces types,
and says whether a namespace was made or already there."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from helpers import make_write
from http_helpers import AppClient, auth, make_namespace, service, upload
from r3store.protocol.wire import decode_batch


@pytest.fixture
def client(tmp_path: Path) -> Iterator[AppClient]:
    with service(tmp_path, None) as made:
        make_namespace(made)
        yield made


def put_settings(client: AppClient, body: dict[str, Any]) -> Any:
    return client.put("/v1/namespaces/ns/settings", json=body, headers=auth("admin"))


def state(client: AppClient) -> Any:
    """What a refusal must leave as it was: every namespace (spec, settings, policy
    version, trajectories) and the checkpoints of "ns"."""
    listed = client.get("/v1/namespaces", headers=auth("admin")).json()
    described = client.get("/v1/namespaces/ns", headers=auth("admin")).json()
    points = client.get("/v1/namespaces/ns/checkpoints", headers=auth("admin")).json()
    return listed, described, points


def sample(client: AppClient, **body: Any) -> Any:
    return client.post(
        "/v1/namespaces/ns/routes/sample", json={"n": 2, **body}, headers=auth("reader")
    )


@pytest.mark.parametrize(
    "body",
    [
        {"max_policy_lag": 2**64},
        {"max_policy_lag": 2**63},
        {"max_times_sampled": 2**64},
        {"max_times_sampled": 2**31},
        {"retention": {"keep_versions": 2**63}},
        {"retention": {"ttl_seconds": 1e11}},
        {"max_policy_lag": "3"},
        {"max_policy_lag": True},
        {"max_policy_lag": 3.0},
        {"max_times_sampled": "1"},
        {"retention": {"evict_after_sampled": "yes"}},
        {"retention": {"ttl_seconds": "60"}},
    ],
)
def test_settings_out_of_range_or_of_the_wrong_type(
    client: AppClient, body: dict[str, Any]
) -> None:
    before = state(client)
    response = put_settings(client, body)
    assert response.status_code == 422, response.text
    assert response.json()["error"]["code"] == "invalid_request"
    assert state(client) == before
    assert sample(client).status_code == 200  # the namespace still works


def test_non_finite_ttl(client: AppClient) -> None:
    before = state(client)
    for text in (
        b'{"retention": {"ttl_seconds": Infinity}}',
        b'{"retention": {"ttl_seconds": NaN}}',
    ):
        response = client.put(
            "/v1/namespaces/ns/settings",
            content=text,
            headers={**auth("admin"), "Content-Type": "application/json"},
        )
        assert response.status_code == 422, response.text
        assert state(client) == before


def test_largest_settings_keep_the_namespace_working(client: AppClient) -> None:
    """The bounds are what the catalog holds: at the maximum, sampling still works."""
    assert upload(client, [make_write("a", policy_version=3)]).status_code == 200
    response = put_settings(
        client,
        {
            "max_policy_lag": 2**63 - 1,
            "max_times_sampled": 2**31 - 1,
            "retention": {"keep_versions": 2**63 - 1, "ttl_seconds": 1e10},
        },
    )
    assert response.status_code == 200, response.text
    policy = client.put(
        "/v1/namespaces/ns/policy-version",
        json={"policy_version": 2**63 - 1, "force": True},
        headers=auth("admin"),
    )
    assert policy.status_code == 200, policy.text
    taken = sample(client)
    assert taken.status_code == 200, taken.text
    assert decode_batch(taken.content)[1].ids == ["a"]
    client.app.state.maintenance.run()  # retention arithmetic at the bounds


@pytest.mark.parametrize(
    ("path", "body"),
    [
        (
            "/v1/namespaces",
            {"name": "x", "spec": {"num_layers": "48", "num_experts": 8, "top_k": 2}},
        ),
        (
            "/v1/namespaces",
            {"name": "x", "spec": {"num_layers": True, "num_experts": 8, "top_k": 2}},
        ),
        ("/v1/namespaces/ns/routes/sample", {"n": "2"}),
        ("/v1/namespaces/ns/routes/sample", {"n": 2, "seed": 2**63}),
        ("/v1/namespaces/ns/routes/batch", {"ids": ["a"], "include_stale": 1}),
    ],
)
def test_requests_of_the_wrong_type(client: AppClient, path: str, body: dict[str, Any]) -> None:
    assert upload(client, [make_write("a")]).status_code == 200
    before = state(client)
    response = client.post(path, json=body, headers=auth("admin"))
    assert response.status_code == 422, response.text
    assert state(client) == before  # nothing made


def test_policy_version_bounds_and_types(client: AppClient) -> None:
    before = state(client)
    for value in (2**63, -1, "4", True):
        response = client.put(
            "/v1/namespaces/ns/policy-version",
            json={"policy_version": value},
            headers=auth("trainer"),
        )
        assert response.status_code == 422, (value, response.text)
    forced = client.put(
        "/v1/namespaces/ns/policy-version",
        json={"policy_version": 1, "force": 1},
        headers=auth("admin"),
    )
    assert forced.status_code == 422, forced.text
    assert state(client) == before


def set_version(client: AppClient, role: str, version: int, **body: Any) -> Any:
    return client.put(
        "/v1/namespaces/ns/policy-version",
        json={"policy_version": version, **body},
        headers=auth(role),
    )


def test_a_bad_policy_version_move_is_bounded_repairable_and_deletes_nothing(
    tmp_path: Path,
) -> None:
    """What one key could do to a namespace by moving its policy version: a reader not
    at all; a trainer at most R3STORE_MAX_POLICY_STEP forward per call, and retention
    keeps what the versions holding routes hold; an admin sets it back with force."""
    keep_two = {"max_policy_lag": 1, "retention": {"keep_versions": 2}}
    with service(tmp_path, None, max_policy_step=1000) as client:
        make_namespace(client)
        assert put_settings(client, keep_two).status_code == 200
        for v in range(3):
            assert set_version(client, "trainer", v).status_code == 200
            assert upload(client, [make_write(f"v{v}", policy_version=v)]).status_code == 200

        refused = set_version(client, "reader", 2**63 - 1)
        assert refused.status_code == 403, refused.text  # a reader reads, no more
        too_far = set_version(client, "trainer", 2 + 1001)
        assert too_far.status_code == 400, too_far.text
        assert "at most 1000" in too_far.json()["error"]["message"]
        assert set_version(client, "trainer", 2**63 - 1).status_code == 400
        assert set_version(client, "trainer", 2, force=True).status_code == 403
        assert set_version(client, "writer", 3).status_code == 403

        jumped = set_version(client, "trainer", 2 + 1000)  # a mistaken, allowed move
        assert jumped.status_code == 200, jumped.text
        client.app.state.maintenance.run()
        body = client.get("/v1/namespaces/ns", headers=auth("admin")).json()
        # the last two versions holding routes stay; v0 goes, as it would have without
        # the jump (numbers alone, 1001 and 1002, would have dropped all three)
        assert body["trajectories"] == 2
        kept = client.post(
            "/v1/namespaces/ns/routes/batch",
            json={"ids": ["v0", "v1", "v2"], "include_stale": True},
            headers=auth("reader"),
        )
        assert decode_batch(kept.content)[1].missing == ["v0"]

        assert set_version(client, "trainer", 2).status_code == 400  # never back, unforced
        assert set_version(client, "admin", 2).status_code == 400
        back = set_version(client, "admin", 2, force=True)  # the repair
        assert back.status_code == 200, back.text
        assert back.json()["policy_version"] == 2
        assert upload(client, [make_write("v2b", policy_version=2)]).status_code == 200
        taken = sample(client)
        assert sorted(decode_batch(taken.content)[1].ids) == ["v1", "v2"]
        far = set_version(client, "admin", 2**63 - 1, force=True)
        assert far.status_code == 200, far.text
        assert set_version(client, "admin", 3, force=True).status_code == 200


def test_expert_load_takes_both_version_bounds(client: AppClient) -> None:
    for v in range(3):
        assert set_version(client, "trainer", v).status_code == 200
        assert upload(client, [make_write(f"v{v}", policy_version=v)]).status_code == 200

    def versions(query: str) -> Any:
        return client.get(f"/v1/namespaces/ns/stats/experts?{query}", headers=auth("reader"))

    def shown(query: str) -> list[int]:
        answer = versions(query)
        assert answer.status_code == 200, answer.text
        return [v["policy_version"] for v in answer.json()["versions"]]

    assert shown("") == [0, 1, 2]
    assert shown("max_version=1") == [0, 1]
    assert shown("min_version=1") == [1, 2]
    assert shown("min_version=1&max_version=1") == [1]
    for query in ("max_version=-1", f"max_version={2**63}", f"min_version={2**63}"):
        assert versions(query).status_code == 422, query


def _integer_bounds(node: Any) -> Iterator[tuple[str, Any]]:
    if isinstance(node, dict):
        if node.get("type") == "integer":
            for key in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                if key in node:
                    yield key, node[key]
        for value in node.values():
            yield from _integer_bounds(value)
    elif isinstance(node, list):
        for value in node:
            yield from _integer_bounds(value)


def test_openapi_states_integer_bounds_as_integers(client: AppClient) -> None:
    schema = json.loads(client.get("/openapi.json").text)
    bounds = list(_integer_bounds(schema))
    assert len(bounds) > 10
    for key, value in bounds:
        assert isinstance(value, int), (key, value)
        assert -(2**63) <= value <= 2**63 - 1
    version = schema["components"]["schemas"]["PolicyVersionSet"]["properties"]["policy_version"]
    assert version["maximum"] == 2**63 - 1


def test_recreating_a_namespace(client: AppClient) -> None:
    spec = {"num_layers": 4, "num_experts": 64, "top_k": 4}
    same = client.post("/v1/namespaces", json={"name": "ns", "spec": spec}, headers=auth("admin"))
    assert same.status_code == 200, same.text  # an identical request: idempotent
    assert same.json()["name"] == "ns"
    other = client.post(
        "/v1/namespaces",
        json={"name": "ns", "spec": spec, "settings": {"max_policy_lag": 3}},
        headers=auth("admin"),
    )
    assert other.status_code == 409, other.text
    assert other.json()["error"]["code"] == "conflict"
    assert "max_policy_lag None, not 3" in other.json()["error"]["message"]
    wider = client.post(
        "/v1/namespaces",
        json={"name": "ns", "spec": {**spec, "top_k": 8}},
        headers=auth("admin"),
    )
    assert wider.status_code == 409
    assert "top_k 4, not 8" in wider.json()["error"]["message"]
    described = client.get("/v1/namespaces/ns", headers=auth("admin")).json()
    assert described["settings"]["max_policy_lag"] is None
    assert described["spec"]["top_k"] == 4


def test_only_the_documented_pages_are_open(client: AppClient) -> None:
    assert client.get("/docs").status_code == 200
    assert client.get("/openapi.json").status_code == 200
    assert client.get("/redoc").status_code == 404
    assert client.get("/docs/oauth2-redirect").status_code == 404


def test_cli_says_whether_it_created(tmp_path: Path) -> None:
    env = {**os.environ, "R3STORE_DATA_DIR": str(tmp_path)}

    def create(*extra: str) -> subprocess.CompletedProcess[str]:
        args = ["namespaces", "create", "run1", "--layers", "4", "--experts", "8", "--top-k", "2"]
        return subprocess.run(
            [sys.executable, "-m", "r3store_server.cli", "--json", *args, *extra],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )

    first = create()
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout)["created"] is True
    again = create()
    assert again.returncode == 0, again.stderr
    assert json.loads(again.stdout)["created"] is False
    other = subprocess.run(
        [
            sys.executable,
            "-m",
            "r3store_server.cli",
            "namespaces",
            "create",
            "run1",
            "--layers",
            "4",
            "--experts",
            "8",
            "--top-k",
            "1",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert other.returncode == 1
    assert "Conflict" in other.stderr
    assert "top_k 2, not 1" in other.stderr
