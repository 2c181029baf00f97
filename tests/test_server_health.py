"""The service skeleton: built from settings, health and readiness over HTTP."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from r3store_server.app import create_app
from r3store_server.settings import Settings


@pytest.mark.parametrize("embedded", [True, False])
def test_health_and_readiness(
    tmp_path: Path, embedded: bool, request: pytest.FixtureRequest
) -> None:
    import asyncio

    env: dict[str, object] = {"data_dir": tmp_path}
    if not embedded:
        seaweed = request.getfixturevalue("seaweed")
        store = seaweed.new_store()
        env["s3"] = {
            "endpoint_url": seaweed.endpoint_url,
            "bucket": store.bucket,
            "prefix": store.config.prefix,
            "access_key_id": seaweed.access_key_id,
            "secret_access_key": seaweed.secret_access_key,
        }
    settings = Settings(**env)  # type: ignore[arg-type]
    assert settings.embedded is embedded
    app = create_app(settings)

    async def probe() -> tuple[int, int]:
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://r3") as client:
                health = await client.get("/healthz")
                ready = await client.get("/readyz")
                return health.status_code, ready.status_code

    assert asyncio.run(probe()) == (200, 200)


def test_settings_from_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("R3STORE_S3__ENDPOINT_URL", "http://127.0.0.1:9000")
    monkeypatch.setenv("R3STORE_S3__BUCKET", "routes")
    settings = Settings()
    assert settings.data_dir == tmp_path
    assert settings.s3.bucket == "routes"
    assert not settings.embedded
    assert settings.resolved_catalog_url() == f"sqlite:///{tmp_path / 'catalog.db'}"
