"""Every endpoint x every role, with no key and with a bad key: allowed, 401 or 403."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from helpers import make_write
from http_helpers import KEYS, SPEC_JSON, AppClient, make_namespace, service
from r3store.wire import CONTENT_TYPE, encode_writes
from r3store_server.app import create_app
from r3store_server.settings import Settings

CALLERS = ["admin", "writer", "reader", "other", "none", "bad"]
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
    "list": {"admin", "writer", "reader", "other"},
    "describe": {"admin", "writer", "reader"},
    "delete": {"admin"},
    "settings": {"admin"},
    "policy": {"admin", "reader"},
    "upload": {"admin", "writer"},
    "batch": {"admin", "reader"},
    "sample": {"admin", "reader"},
    "metrics": {"admin"},
    "healthz": set(CALLERS),
    "readyz": set(CALLERS),
    "openapi": set(CALLERS),
}


def test_auth_matrix(tmp_path: Path) -> None:
    wrong = []
    with service(tmp_path, None) as client:
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
