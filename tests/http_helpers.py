"""A service with real S3 behind it and one key per role, for the HTTP tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio.from_thread
import httpx
import numpy as np
from fastapi import FastAPI

from helpers import SPEC
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.records import TrajectoryWrite
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.service import free_port, stop_server, wait_ready
from r3store_client import Client, Retry
from r3store_server.app import create_app
from r3store_server.settings import Settings

if TYPE_CHECKING:
    import pytest

    from r3store.policy import NamespaceSettings

KEYS = {
    "admin": "admin-key-0123456789abcdefghij",
    "writer": "writer-key-0123456789abcdefghij",
    "reader": "reader-key-0123456789abcdefghij",
    "trainer": "trainer-key-0123456789abcdefghi",
    "other": "other-reader-key-0123456789abcd",  # a reader scoped to namespace "other"
}
SPEC_JSON = {"num_layers": 4, "num_experts": 64, "top_k": 4}
# namespace "ns" whose retention keeps the current policy version only
KEEP_ONE_VERSION = {
    "name": "ns",
    "spec": SPEC_JSON,
    "settings": {"retention": {"keep_versions": 1}},
}


def settings_for(tmp: Path, seaweed: SeaweedFS | None, **extra: Any) -> Settings:
    env: dict[str, Any] = {
        "data_dir": tmp,
        "api_keys": [
            {"name": "admin", "role": "admin", "key": KEYS["admin"]},
            {"name": "writer", "role": "writer", "key": KEYS["writer"]},
            {"name": "reader", "role": "reader", "key": KEYS["reader"]},
            {"name": "trainer", "role": "trainer", "key": KEYS["trainer"]},
            {"name": "other", "role": "reader", "key": KEYS["other"], "namespaces": ["other"]},
        ],
        "log_json": False,
        **extra,
    }
    if seaweed is not None:
        store = seaweed.new_store()
        store.close()
        env["store"] = "s3"
        env["s3"] = {
            "endpoint_url": seaweed.endpoint_url,
            "bucket": store.bucket,
            "prefix": store.config.prefix,
            "access_key_id": seaweed.access_key_id,
            "secret_access_key": seaweed.secret_access_key,
        }
    return Settings(**env)


class AppClient:
    """A synchronous client over httpx's ASGI transport, with the app's lifespan running
    in a background event loop: real HTTP semantics, no sockets."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self._portal_cm = anyio.from_thread.start_blocking_portal()
        self._portal = self._portal_cm.__enter__()
        self._lifespan = self._portal.wrap_async_context_manager(app.router.lifespan_context(app))
        self._lifespan.__enter__()
        transport = httpx.ASGITransport(app=app)
        self._client = httpx.AsyncClient(transport=transport, base_url="http://r3store")

    def request(self, method: str, url: str, **kwargs: Any) -> httpx.Response:
        return self._portal.call(lambda: self._client.request(method, url, **kwargs))

    def get(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("GET", url, **kwargs)

    def post(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("POST", url, **kwargs)

    def put(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("PUT", url, **kwargs)

    def delete(self, url: str, **kwargs: Any) -> httpx.Response:
        return self.request("DELETE", url, **kwargs)

    def close(self) -> None:
        try:
            self._portal.call(self._client.aclose)
            self._lifespan.__exit__(None, None, None)
        finally:
            self._portal_cm.__exit__(None, None, None)


@contextmanager
def service(tmp: Path, seaweed: SeaweedFS | None, **extra: Any) -> Iterator[AppClient]:
    client = AppClient(create_app(settings_for(tmp, seaweed, **extra)))
    try:
        yield client
    finally:
        client.close()


def auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


def make_namespace(client: AppClient, name: str = "ns", **spec: Any) -> None:
    body = {"name": name, "spec": {**SPEC_JSON, **spec}}
    response = client.post("/v1/namespaces", json=body, headers=auth("admin"))
    assert response.status_code == 201, response.text


def upload(
    client: AppClient, writes: list[TrajectoryWrite], ns: str = "ns", role: str = "writer"
) -> Any:
    return client.post(
        f"/v1/namespaces/{ns}/trajectories",
        content=encode_writes(writes),
        headers={**auth(role), "Content-Type": CONTENT_TYPE},
    )


def read(client: AppClient, ids: list[str], ns: str = "ns", **options: Any) -> Any:
    response = client.post(
        f"/v1/namespaces/{ns}/routes/batch", json={"ids": ids, **options}, headers=auth("reader")
    )
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == CONTENT_TYPE
    return decode_batch(response.content)[1]


def stored_state(client: AppClient, ns: str = "ns") -> tuple[int, int]:
    """(trajectories, policy version) as the service reports them."""
    body = client.get(f"/v1/namespaces/{ns}", headers=auth("admin")).json()
    return body["trajectories"], body["policy_version"]


def as_array(x: Any) -> np.ndarray:
    return np.asarray(x)


class ServerProcess:
    """`r3store-server` in its own process (real uvicorn) on a free port."""

    def __init__(
        self,
        tmp: Path,
        seaweed: SeaweedFS | None,
        prefix: str | None = None,
        port: int | None = None,
        wait: bool = True,
        catalog_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        import json
        import os
        import subprocess
        import sys

        self.port = port if port is not None else free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        settings = settings_for(tmp, None)
        full_env = {
            **os.environ,
            "R3STORE_PORT": str(self.port),
            "R3STORE_DATA_DIR": str(tmp),
            "R3STORE_API_KEYS": json.dumps(
                [
                    {
                        "name": k.name,
                        "role": k.role,
                        "key": k.key.get_secret_value(),
                        "namespaces": k.namespaces,
                    }
                    for k in settings.api_keys
                    if k.key is not None
                ]
            ),
        }
        if catalog_url is not None:
            full_env["R3STORE_CATALOG_URL"] = catalog_url
        if seaweed is not None:
            if prefix is None:
                probe = seaweed.new_store()
                prefix = probe.config.prefix
                probe.close()
            self.prefix = prefix
            full_env.update(
                {
                    "R3STORE_STORE": "s3",
                    "R3STORE_S3__ENDPOINT_URL": seaweed.endpoint_url,
                    "R3STORE_S3__BUCKET": seaweed.config().bucket,
                    "R3STORE_S3__PREFIX": self.prefix,
                    "R3STORE_S3__ACCESS_KEY_ID": seaweed.access_key_id,
                    "R3STORE_S3__SECRET_ACCESS_KEY": seaweed.secret_access_key,
                }
            )
        full_env.update(env or {})
        self.env = full_env
        self.log = (tmp / f"server-{self.port}.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "r3store_server.main"],
            env=full_env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        if wait:
            wait_ready(self.process, self.url)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def kill(self) -> None:
        import signal

        if self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
        self.process.wait(timeout=10)
        self.log.close()

    def stop(self) -> None:
        stop_server(self.process)
        self.log.close()

    def cli(self, *args: str) -> Any:
        """What `r3store --json <args>` prints, parsed, run with this server's settings
        (its catalog and store; not its port); it must exit 0."""
        import json
        import os
        import subprocess
        import sys

        env = {k: v for k, v in os.environ.items() if not k.startswith("R3STORE_")}
        env.update(
            {k: v for k, v in self.env.items() if k.startswith("R3STORE_") and k != "R3STORE_PORT"}
        )
        done = subprocess.run(
            [sys.executable, "-m", "r3store_server.cli", "--json", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout)


def server_maintained_each_second(tmp: Path, seaweed: SeaweedFS | None) -> ServerProcess:
    """A server whose maintenance passes run every second, collecting without grace."""
    env = {"R3STORE_MAINTENANCE_INTERVAL": "1", "R3STORE_MAINTENANCE_GRACE": "0"}
    return ServerProcess(tmp, seaweed, env=env)


def client_for(server: ServerProcess, role: str = "admin") -> Client:
    """A client of `server` with `role`'s key that retries quickly (3 attempts, backing
    off from 0.05 s)."""
    return Client(server.url, api_key=KEYS[role], retry=Retry(attempts=3, backoff=0.05))


def namespace_named_after(
    request: pytest.FixtureRequest, client: Client, settings: NamespaceSettings | None = None
) -> str:
    """A namespace of `helpers.SPEC` made with `client`, named after the test: the first
    40 characters of its name, any but letters and digits as "-"."""
    name = "".join(c if c.isalnum() else "-" for c in request.node.name[:40])
    client.create_namespace(name, SPEC, settings)
    return name


@contextmanager
def replicas(
    tmp: Path, seaweed: SeaweedFS, catalog_url: str, env: dict[str, str] | None = None
) -> Iterator[tuple[ServerProcess, ServerProcess]]:
    """Two server processes sharing one bucket prefix and one catalog database."""
    (tmp / "a").mkdir()
    (tmp / "b").mkdir()
    a = ServerProcess(tmp / "a", seaweed, catalog_url=catalog_url, env=env)
    try:
        b = ServerProcess(tmp / "b", seaweed, prefix=a.prefix, catalog_url=catalog_url, env=env)
    except BaseException:
        a.stop()
        raise
    try:
        yield a, b
    finally:
        a.stop()
        b.stop()


def gauge(client: httpx.Client, name: str) -> float:
    """A series of `/metrics` that carries no labels (`client` holds an admin key)."""
    r = client.get("/metrics")
    assert r.status_code == 200, r.text
    for line in r.text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[1])
    raise AssertionError(f"{name} is not in /metrics")
