from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from helpers import MakeEngine
from r3store.storage.store import LocalStore, ObjectStore
from r3store.testing import postgres, seaweedfs

if TYPE_CHECKING:
    from http_helpers import ServerProcess
    from r3store_client import Client


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Every test that needs the SeaweedFS server is marked `s3` (`-m "not s3"` skips
    them)."""
    for item in items:
        if "seaweed" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.s3)


@pytest.fixture(scope="session")
def seaweed() -> Iterator[seaweedfs.SeaweedFS]:
    """One real SeaweedFS server for the session, on free ports; stopped whatever happens."""
    with seaweedfs.running() as server:
        yield server


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[postgres.Postgres]:
    """One real PostgreSQL server for the session (Debian's package), on a free port."""
    with postgres.running() as server:
        yield server


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ObjectStore]:
    """Each backend in turn; the S3 one on a fresh bucket of the real server."""
    if request.param == "local":
        made: ObjectStore = LocalStore(tmp_path / "objects")
    else:
        made = request.getfixturevalue("seaweed").new_store()
    yield made
    made.close()


@pytest.fixture
def make_engine(tmp_path: Path) -> Iterator[MakeEngine]:
    """`make_engine(store, config=None)`: an engine with a SQLite catalog in tmp_path;
    `make_engine.catalog()` opens that catalog again, behind the engine's back."""
    made = MakeEngine(tmp_path)
    yield made
    made.close()


@pytest.fixture
def client(server: ServerProcess) -> Iterator[Client]:
    """An admin client of the test module's own `server` fixture, retrying quickly
    (`http_helpers.client_for`); a module that needs another client defines its own."""
    from http_helpers import client_for  # it loads the web application: only when asked

    with client_for(server) as made:
        yield made


@pytest.fixture
def namespace(client: Client, request: pytest.FixtureRequest) -> str:
    """A namespace made with `client`, named after the test
    (`http_helpers.namespace_named_after`)."""
    from http_helpers import namespace_named_after

    return namespace_named_after(request, client)
