"""Every endpoint x every role, with no key and with a bad key: allowed, 401 or 403."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from helpers import make_write
from http_helpers import KEYS, SPEC_JSON, AppClient, make_namespace, service, settings_for
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store_server.app import create_app
from r3store_server.settings import Settings

CALLERS = ["admin", "writer", "reader", "trainer", "other", "none", "bad"]
counter = itertools.count()


def headers(caller: str) -> dict[str, str]:
    if caller == "none":
        return {}
    if caller == "bad":
        return {"Authorization": "Bearer not-a-key-of-ours-at-all-0000"}
    if caller == "reader":  # the other header form works too
        return {"X-API-Key": KEYS[caller]}
    return {"Authorization": f"Bearer {KEYS[caller]}"}


def call(client: AppClient, endpoint: str, caller: str) -> int:
    h = headers(caller)
    n = next(counter)
    requests: dict[str, Any] = {
        "create": lambda: client.post(
            "/v1/namespaces", json={"name": f"new{n}", "spec": SPEC_JSON}, headers=h
        ),
        "list": lambda: client.get("/v1/namespaces", headers=h),
        "describe": lambda: client.get("/v1/namespaces/ns", headers=h),
        "delete": lambda: client.delete(f"/v1/namespaces/{doomed(client)}", headers=h),
        "settings": lambda: client.put("/v1/namespaces/ns/settings", json={}, headers=h),
        "policy": lambda: client.put(
            "/v1/namespaces/ns/policy-version", json={"policy_version": n}, headers=h
        ),
        "force": lambda: client.put(
            "/v1/namespaces/ns/policy-version",
            json={"policy_version": n, "force": True},
            headers=h,
        ),
        "upload": lambda: client.post(
            "/v1/namespaces/ns/trajectories",
            content=encode_writes([make_write(f"w{n}", tokens=8)]),
            headers={**h, "Content-Type": CONTENT_TYPE},
        ),
        "batch": lambda: client.post(
            "/v1/namespaces/ns/routes/batch", json={"ids": ["w0"]}, headers=h
        ),
        "sample": lambda: client.post("/v1/namespaces/ns/routes/sample", json={"n": 1}, headers=h),
        "metrics": lambda: client.get("/metrics", headers=h),
        "healthz": lambda: client.get("/healthz", headers=h),
        "readyz": lambda: client.get("/readyz", headers=h),
        "openapi": lambda: client.get("/openapi.json", headers=h),
    }
    return int(requests[endpoint]().status_code)


def doomed(client: AppClient) -> str:
    name = f"doomed{next(counter)}"
    make_namespace(client, name)
    return name


ALLOWED = {
    "create": {"admin"},
    "list": {"admin", "writer", "reader", "trainer", "other"},
    "describe": {"admin", "writer", "reader", "trainer"},
    "delete": {"admin"},
    "settings": {"admin"},
    "policy": {"admin", "trainer"},
    "force": {"admin"},
    "upload": {"admin", "writer"},
    "batch": {"admin", "reader", "trainer"},
    "sample": {"admin", "reader", "trainer"},
    "metrics": {"admin"},
    "healthz": set(CALLERS),
    "readyz": set(CALLERS),
    "openapi": set(CALLERS),
}


def test_auth_matrix(tmp_path: Path) -> None:
    wrong = []
    with service(tmp_path, None, auth_failure_limit=1000) as client:  # many bad keys, one address
        make_namespace(client)
        for endpoint, allowed in ALLOWED.items():
            for caller in CALLERS:
                status = call(client, endpoint, caller)
                if caller in allowed:
                    ok = 200 <= status < 300
                elif caller in ("none", "bad"):
                    ok = status == 401
                else:
                    ok = status == 403
                if not ok:
                    wrong.append((endpoint, caller, status))
    assert not wrong, wrong


def test_auth_may_be_off_only_on_loopback(tmp_path: Path) -> None:
    with service(tmp_path, None, api_keys=[]) as client:  # no keys, loopback: auth off
        assert client.get("/metrics").status_code == 200
    with pytest.raises(ValueError, match="loopback"):
        create_app(Settings(data_dir=tmp_path, host="0.0.0.0"))
    with pytest.raises(ValueError, match="loopback"):
        create_app(Settings(data_dir=tmp_path, auth="off", host="10.1.2.3"))
    with (
        pytest.raises(ValueError, match="no API keys"),
        service(tmp_path, None, api_keys=[], auth="on"),
    ):
        pass


def test_keys_from_a_secrets_file_are_hashed(tmp_path: Path) -> None:
    import hashlib
    import json

    keyfile = tmp_path / "keys.json"
    digest = hashlib.sha256(b"file-key-0123456789abcdefghijkl").hexdigest()
    keyfile.write_text(json.dumps([{"name": "ops", "role": "admin", "key_sha256": digest}]))
    with service(tmp_path, None, api_keys=[], api_keys_file=keyfile) as client:
        ok = client.get(
            "/metrics", headers={"Authorization": "Bearer file-key-0123456789abcdefghijkl"}
        )
        assert ok.status_code == 200
        assert client.get("/metrics").status_code == 401
    with pytest.raises(ValueError, match="shorter than 24"):
        Settings(api_keys=[{"name": "x", "role": "admin", "key": "short"}])


def the_keys() -> list[dict[str, Any]]:
    """The test service's keys, as R3STORE_API_KEYS lists them."""
    return [
        {
            "name": k.name,
            "role": k.role,
            "key": k.key.get_secret_value(),
            "namespaces": k.namespaces,
        }
        for k in settings_for(Path("."), None).api_keys
        if k.key is not None
    ]


def test_the_role_table_is_the_code() -> None:
    """docs/api.md's "Keys and roles" table names each role's rights as auth.py does."""
    import re

    from r3store_server.auth import ROLES
    from r3store_server.settings import Role

    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    section = text.split("## Keys and roles", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \| [^|]+ \| ([^|]+) \|", section, flags=re.M)
    documented = {role: set(re.findall(r"`(\w+)`", rights)) for role, rights in rows}
    assert documented == {role: set(rights) for role, rights in ROLES.items()}
    assert set(ROLES) == set(Role.__args__)  # type: ignore[attr-defined]


def test_every_error_code_is_documented() -> None:
    import re

    from r3store_server.errors import STATUS

    text = (Path(__file__).parent.parent / "docs" / "api.md").read_text()
    section = text.split("## Errors", 1)[1].split("\n## ", 1)[0]
    table = section[section.index("| status | code |") :].split("\n\n", 1)[0]
    documented = set(re.findall(r"^\| [^|]+ \| `(\w+)` \|", table, flags=re.M))
    answered = {kind.code for kind, _ in STATUS} | {
        "invalid_routes",
        "invalid_spec",
        "invalid_request",
        "method_not_allowed",
        "http_error",
        "internal",
    }
    assert answered <= documented, answered - documented


def test_unknown_keys_from_one_address_are_refused_for_a_while(tmp_path: Path) -> None:
    import httpx

    from http_helpers import ServerProcess

    server = ServerProcess(tmp_path, None, env={"R3STORE_AUTH_FAILURE_LIMIT": "5"})
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:

            def get(path: str, key: str, address: str) -> httpx.Response:
                # uvicorn takes the client's address from X-Forwarded-For when the peer
                # is a proxy it trusts (127.0.0.1 by default): two clients, one machine
                sent = {"X-API-Key": key, "X-Forwarded-For": address}
                return http.get(path, headers=sent)

            bad = "not-a-key-of-ours-at-all-0000"
            for _ in range(5):
                assert get("/v1/namespaces", bad, "10.0.0.1").status_code == 401
            refused = get("/v1/namespaces", bad, "10.0.0.1")
            assert refused.status_code == 429, refused.text
            assert refused.json()["error"]["code"] == "too_many_failures"
            assert 1 <= int(refused.headers["retry-after"]) <= 60
            # a known key from there is still let in: behind a proxy or NAT many clients
            # share the address, and one stale key must not lock the others out
            assert get("/v1/namespaces", KEYS["admin"], "10.0.0.1").status_code == 200
            assert get("/v1/namespaces", bad, "10.0.0.1").status_code == 429
            page = get("/ui", bad, "10.0.0.1")
            assert page.status_code == 429
            assert "retry-after" in page.headers
            assert get("/v1/namespaces", KEYS["admin"], "10.0.0.2").status_code == 200
            assert get("/v1/namespaces", bad, "10.0.0.2").status_code == 401
            assert get("/healthz", bad, "10.0.0.1").status_code == 200  # open pages stay open
    finally:
        server.stop()


def test_failed_keys_are_remembered_for_a_bounded_number_of_addresses() -> None:
    from r3store.errors import TooManyFailures
    from r3store_server.auth import FailedKeys

    failures = FailedKeys(limit=2, window=60, addresses=100)
    for i in range(10_000):
        failures.failed(f"10.{i // 65536}.{i // 256 % 256}.{i % 256}")
    assert len(failures) == 100
    failures.failed("192.0.2.1")
    failures.check("192.0.2.1")
    failures.failed("192.0.2.1")
    with pytest.raises(TooManyFailures):
        failures.check("192.0.2.1")
    failures.check("10.0.0.0")  # forgotten: the longest quiet


def test_readiness_says_less_without_a_key(tmp_path: Path) -> None:
    from http_helpers import auth

    unreachable = {
        "endpoint_url": "http://127.0.0.1:9",
        "bucket": "nowhere-bucket",
        "access_key_id": "an-access-key-id",
        "secret_access_key": "a-secret-access-key",
    }
    with service(tmp_path, None, store="s3", s3=unreachable) as client:
        for sent in ({}, {"X-API-Key": "not-a-key-of-ours-at-all-0000"}):
            brief = client.get("/readyz", headers=sent)
            assert brief.status_code == 503
            detail = brief.json()["detail"]
            failed = (
                "the object store is unavailable",
                "the object store or the catalog did not answer in time",
            )
            starting = tuple(f"the service is starting: {f}" for f in failed)
            assert detail in (*failed, *starting, "the service is starting"), detail
            assert "127.0.0.1" not in detail
            assert "nowhere" not in detail
        full = client.get("/readyz", headers=auth("reader"))
        assert full.status_code == 503
        assert "127.0.0.1:9" in full.json()["detail"], full.text


def test_a_scoped_admin_sees_its_namespaces_in_metrics(tmp_path: Path) -> None:
    import time

    from http_helpers import auth

    scoped_key = "scoped-admin-key-0123456789abc"
    keys = [*the_keys(), {"name": "ops", "role": "admin", "key": scoped_key, "namespaces": ["ns"]}]
    with service(tmp_path, None, api_keys=keys, metrics_interval=0.2) as client:
        make_namespace(client, "ns")
        make_namespace(client, "other")
        deadline = time.monotonic() + 30
        while True:
            everything = client.get("/metrics", headers=auth("admin")).text
            if 'namespace="ns"' in everything and 'namespace="other"' in everything:
                break
            assert time.monotonic() < deadline, everything
            time.sleep(0.2)
        mine = client.get("/metrics", headers={"X-API-Key": scoped_key})
        assert mine.status_code == 200
        assert 'r3store_namespace_policy_version{namespace="ns"}' in mine.text
        assert 'namespace="other"' not in mine.text
        assert "r3store_http_requests_total" in mine.text  # the server's own series


def test_routes_of_another_source_annotate_only_the_writers_own(tmp_path: Path) -> None:
    import sqlite3

    from http_helpers import auth, read, upload

    second = "second-writer-key-0123456789ab"
    keys = [*the_keys(), {"name": "writer2", "role": "writer", "key": second}]

    def as_second(writes: list[Any]) -> Any:
        return client.post(
            "/v1/namespaces/ns/trajectories",
            content=encode_writes(writes),
            headers={"X-API-Key": second, "Content-Type": CONTENT_TYPE},
        )

    with service(tmp_path, None, api_keys=keys) as client:
        make_namespace(client)
        assert upload(client, [make_write("t", tokens=8)]).status_code == 200
        predicted = make_write("t", tokens=8, source="predicted")
        refused = as_second([predicted])
        assert refused.status_code == 403, refused.text
        assert refused.json()["error"]["code"] == "forbidden"
        assert [i.source for i in read(client, ["t"]).items] == ["engine"]  # nothing stored
        assert upload(client, [predicted]).status_code == 200  # its own writer may
        assert [i.source for i in read(client, ["t"]).items] == ["predicted"]
        trainer = make_write("t", tokens=8, source="trainer")
        assert upload(client, [trainer], role="admin").status_code == 200  # the annotate right
        both = [make_write("u", tokens=8), make_write("u", tokens=8, source="predicted")]
        assert as_second(both).status_code == 200  # annotating in the same upload
        retried = as_second([make_write("u", tokens=8, source="predicted")])
        assert retried.status_code == 200
        assert retried.json()["results"][0]["created"] is False
        assert upload(client, [make_write("u", tokens=8, source="trainer")]).status_code == 403

    # a catalog made before writers were recorded: the column is added, empty, and its
    # trajectories are nobody's: only a key with the annotate right annotates them
    with sqlite3.connect(tmp_path / "catalog.db") as db:
        db.execute("ALTER TABLE trajectories DROP COLUMN writer")
        db.execute("DROP TABLE alembic_version")  # made before migrations, too
    with service(tmp_path, None, api_keys=keys) as client:
        trainer = make_write("u", tokens=8, source="trainer")
        assert upload(client, [trainer]).status_code == 403
        assert upload(client, [trainer], role="admin").status_code == 200
        assert upload(client, [make_write("v", tokens=8)]).status_code == 200
        assert upload(client, [make_write("v", tokens=8, source="trainer")]).status_code == 200
        described = client.get("/v1/namespaces/ns", headers=auth("admin")).json()
        assert described["trajectories"] == 3


def test_swagger_ui_does_not_keep_an_authorized_key(tmp_path: Path) -> None:
    with service(tmp_path, None) as client:
        page = client.get("/docs").text
        assert '"persistAuthorization": false' in page
        assert '"persistAuthorization": true' not in page


# every /v1 route of the application's own route table, against docs/api.md's roles

API = Path(__file__).resolve().parents[1] / "docs" / "api.md"
# who passes a route of each documented role ("other" is a reader scoped to another
# namespace: it passes only what names no namespace)
PASSES = {
    "admin": {"admin"},
    "writer": {"admin", "writer"},
    "reader": {"admin", "reader", "trainer"},
    "trainer": {"admin", "trainer"},
    "any": {"admin", "writer", "reader", "trainer"},
    "the key that took it, or admin": {"admin", "reader", "trainer"},  # none took lease 0..0
}


def documented_roles() -> dict[tuple[str, str], str]:
    """`(method, path with {} for each parameter)`: the role docs/api.md gives it."""
    import re

    rows = re.findall(
        r"^\| `(GET|POST|PUT|DELETE) ([^`?]+)[^`]*` \| ([^|]+) \|", API.read_text(), re.M
    )
    return {(m, re.sub(r"\{[^}]*\}", "{}", p)): role.strip() for m, p, role in rows}


def v1_routes(tmp: Path) -> list[tuple[str, str]]:
    """Every (method, path template) under /v1 the application serves, from its own
    route table (as its OpenAPI schema lists it)."""
    app = create_app(Settings(data_dir=tmp, api_keys=[]))
    paths = app.openapi()["paths"]
    return sorted(
        (method.upper(), path)
        for path, methods in paths.items()
        if path.startswith("/v1/")
        for method in methods
    )


def test_every_v1_route_answers_each_role_as_documented(tmp_path: Path) -> None:
    import re

    import httpx

    from http_helpers import ServerProcess

    routes = v1_routes(tmp_path / "schema")
    roles = documented_roles()
    served = {(m, re.sub(r"\{[^}]*\}", "{}", p)) for m, p in routes}
    documented = {r for r in roles if r[1].startswith("/v1/")}
    assert served == documented, (served - documented, documented - served)
    assert len(routes) == 27  # what the application serves today, each checked below
    env = {"R3STORE_AUTH_FAILURE_LIMIT": "100000"}
    server = ServerProcess(tmp_path, None, env=env)
    wrong = []
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            admin = {"Authorization": f"Bearer {KEYS['admin']}"}
            made = http.post(
                "/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON}, headers=admin
            )
            assert made.status_code == 201, made.text
            for (method, template), caller in itertools.product(routes, CALLERS):
                role = roles[(method, re.sub(r"\{[^}]*\}", "{}", template))]
                namespace = "ns"
                if method == "DELETE" and template == "/v1/namespaces/{namespace}":
                    namespace = f"doomed{next(counter)}"
                    body = {"name": namespace, "spec": SPEC_JSON}
                    assert http.post("/v1/namespaces", json=body, headers=admin).status_code == 201
                path = template.format(namespace=namespace, lease_id="0" * 32, step=7)
                sent = {"json": {}} if method in ("POST", "PUT") else {}
                status = http.request(method, path, headers=headers(caller), **sent).status_code
                if caller in ("none", "bad"):
                    want = "401"
                elif caller in PASSES[role] or (
                    caller == "other" and "reader" in PASSES[role] and "{namespace}" not in template
                ):
                    want = "passes"
                else:
                    want = "403"
                got = "passes" if status not in (401, 403) else str(status)
                if got != want:
                    wrong.append((method, template, caller, role, status))
    finally:
        server.stop()
    assert not wrong, wrong
