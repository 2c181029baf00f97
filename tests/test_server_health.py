"""The service built from settings: health, readiness, and settings from the environment."""

from __future__ import annotations

from pathlib import Path

import pytest

from http_helpers import service
from r3store_server.settings import Settings


@pytest.mark.parametrize("embedded", [True, False])
def test_health_and_readiness(
    tmp_path: Path, embedded: bool, request: pytest.FixtureRequest
) -> None:
    seaweed = None if embedded else request.getfixturevalue("seaweed")
    with service(tmp_path, seaweed) as client:
        assert client.get("/healthz").status_code == 200
        assert client.get("/readyz").json()["status"] == "ready"


def test_readiness_fails_when_s3_is_unreachable(tmp_path: Path) -> None:
    unreachable = {"endpoint_url": "http://127.0.0.1:9", "bucket": "nowhere"}
    with service(tmp_path, None, s3=unreachable) as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable"


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("R3STORE_S3__ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("R3STORE_S3__BUCKET", "routes")
    monkeypatch.setenv(
        "R3STORE_API_KEYS", '[{"name": "a", "role": "admin", "key": "k-0123456789abcdefghijklmn"}]'
    )
    settings = Settings()
    assert settings.data_dir == tmp_path
    assert settings.s3.bucket == "routes"
    assert not settings.embedded
    assert settings.api_keys[0].role == "admin"
    assert settings.resolved_catalog_url() == f"sqlite:///{tmp_path / 'catalog.db'}"
