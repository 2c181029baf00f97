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
    with service(tmp_path, None, store="s3", s3=unreachable) as client:
        assert client.get("/healthz").status_code == 200
        r = client.get("/readyz")
        assert r.status_code == 503
        assert r.json()["status"] == "unavailable"


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("R3STORE_STORE", "s3")
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


def test_s3_credentials_from_secret_files(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    seaweed = request.getfixturevalue("seaweed")
    (tmp_path / "id").write_text(seaweed.access_key_id + "\n")
    (tmp_path / "secret").write_text(seaweed.secret_access_key)
    store = seaweed.new_store()
    s3 = {
        "endpoint_url": seaweed.endpoint_url,
        "bucket": store.bucket,
        "prefix": store.config.prefix,
        "access_key_id_file": str(tmp_path / "id"),
        "secret_access_key_file": str(tmp_path / "secret"),
    }
    with service(tmp_path, None, store="s3", s3=s3) as client:
        assert client.get("/readyz").json()["status"] == "ready"


def test_full_buffer_answers_429_with_retry_after(tmp_path: Path) -> None:
    import threading
    import time

    from helpers import make_write
    from http_helpers import AppClient, auth, make_namespace, settings_for, upload
    from r3store.engine import Engine, EngineConfig
    from r3store.engine.writer import WriterConfig
    from r3store.storage.catalog import Catalog
    from r3store.storage.store import LocalStore
    from r3store_server.app import create_app

    class Slow(LocalStore):
        def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
            if key.startswith("shards/"):
                time.sleep(1.0)
            super().put_if_absent(key, data)

    engine = Engine(
        Slow(tmp_path / "o"),
        Catalog(f"sqlite:///{tmp_path / 'c.db'}"),
        EngineConfig(writer=WriterConfig(buffer_bytes=1, put_timeout=0.1)),
    )
    client = AppClient(create_app(settings_for(tmp_path, None), engine=engine))
    try:
        make_namespace(client)
        first = threading.Thread(target=upload, args=(client, [make_write("a")]))
        first.start()
        time.sleep(0.3)  # the first upload now holds the whole buffer
        r = upload(client, [make_write("b")])
        first.join()
        assert r.status_code == 429
        assert r.json()["error"]["code"] == "backpressure"
        assert int(r.headers["Retry-After"]) >= 1
        assert client.get("/v1/namespaces/ns", headers=auth("admin")).json()["trajectories"] == 1
    finally:
        client.close()
        engine.close()


def test_the_store_is_chosen_explicitly(tmp_path: Path) -> None:
    from pydantic import ValidationError

    from r3store_server.backends import build_store

    with pytest.raises(ValidationError, match="set R3STORE_STORE=s3"):
        Settings(data_dir=tmp_path, s3={"endpoint_url": "http://127.0.0.1:9000"})
    assert Settings(data_dir=tmp_path).embedded
    aws = build_store(Settings(data_dir=tmp_path, store="s3", s3={"bucket": "routes"}))
    try:
        assert aws.description == "S3 bucket 'routes' at AWS"  # no endpoint: AWS itself
    finally:
        aws.close()
