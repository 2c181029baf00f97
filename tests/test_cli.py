"""The admin CLI end to end, on real S3, through its entry point."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import make_write
from r3store.testing.seaweedfs import SeaweedFS
from r3store_server.backends import build_engine
from r3store_server.settings import Settings


@pytest.fixture
def env(tmp_path: Path, seaweed: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    store = seaweed.new_store()
    store.close()
    values = {
        "R3STORE_DATA_DIR": str(tmp_path),
        "R3STORE_STORE": "s3",
        "R3STORE_S3__ENDPOINT_URL": seaweed.endpoint_url,
        "R3STORE_S3__BUCKET": store.bucket,
        "R3STORE_S3__PREFIX": store.config.prefix,
        "R3STORE_S3__ACCESS_KEY_ID": seaweed.access_key_id,
        "R3STORE_S3__SECRET_ACCESS_KEY": seaweed.secret_access_key,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def cli(*args: str) -> object:
    result = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_cli_end_to_end(env: dict[str, str]) -> None:
    made = cli("namespaces", "create", "run1", "--layers", "4", "--experts", "64", "--top-k", "4")
    assert made["spec"]["num_experts"] == 64  # type: ignore[index]
    assert [n["name"] for n in cli("namespaces", "list")] == ["run1"]  # type: ignore[union-attr]
    engine = build_engine(Settings())
    try:
        engine.put(
            "run1", [make_write(f"t{v}-{i}", policy_version=v) for v in range(3) for i in range(2)]
        )
    finally:
        engine.close()
    stats = cli("stats", "run1")["run1"]  # type: ignore[index]
    assert stats["trajectories"] == 6
    assert stats["by_policy_version"] == {"0": 2, "1": 2, "2": 2}
    assert cli("policy", "run1", "--version", "2")["policy_version"] == 2  # type: ignore[index]
    settings = cli("settings", "run1", "--keep-versions", "1", "--max-lag", "3")
    assert settings["settings"]["retention"]["keep_versions"] == 1  # type: ignore[index]
    report = cli("maintain", "--grace", "0")
    assert report["trajectories_dropped"] == 4  # type: ignore[index]
    assert cli("namespaces", "show", "run1")["trajectories"] == 2  # type: ignore[index]
    rebuilt = cli("rebuild", "--yes")
    assert rebuilt["trajectories"] == 2  # type: ignore[index]
    assert rebuilt["namespaces"] == 1  # type: ignore[index]
    assert cli("namespaces", "show", "run1")["policy_version"] == 2  # type: ignore[index]
    refused = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "namespaces", "delete", "run1"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "--yes" in refused.stderr
    assert cli("namespaces", "delete", "run1", "--yes")["objects_deleted"] >= 2  # type: ignore[index]
    missing = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "namespaces", "show", "run1"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert "NotFound" in missing.stderr


def test_cli_keys_work_against_the_server(tmp_path: Path) -> None:
    import os

    import httpx

    from http_helpers import ServerProcess

    env = {**os.environ, "R3STORE_DATA_DIR": str(tmp_path)}

    def run(*args: str) -> object:
        result = subprocess.run(
            [sys.executable, "-m", "r3store_server.cli", "--json", *args],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert result.returncode == 0, result.stderr
        return json.loads(result.stdout)

    made = run("keys", "create", "trainer", "--role", "reader", "--namespace", "run1")
    key = made["key"]  # type: ignore[index]
    assert len(key) >= 32
    listed = run("keys", "list")
    assert listed == [
        {"name": "trainer", "role": "reader", "namespaces": ["run1"], "revoked": False}
    ]
    assert key not in json.dumps(listed)
    server = ServerProcess(tmp_path, None)  # its settings keys, plus the catalog's
    try:
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{server.url}/v1/namespaces", headers=headers).status_code == 200
        assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 403
        run("keys", "revoke", "trainer")
        time.sleep(5.5)  # the server rereads catalog keys every 5 s
        assert httpx.get(f"{server.url}/v1/namespaces", headers=headers).status_code == 401
    finally:
        server.stop()
