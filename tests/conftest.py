from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from r3store.catalog import Catalog
from r3store.engine import Engine, EngineConfig
from r3store.store import LocalStore, ObjectStore
from r3store.testing import postgres, seaweedfs


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
def make_engine(tmp_path: Path) -> Iterator[object]:
    """`make_engine(store, config=None)`: an engine with a SQLite catalog in tmp_path."""
    engines: list[Engine] = []

    def make(
        store: ObjectStore, config: EngineConfig | None = None, db: str = "catalog.db"
    ) -> Engine:
        engine = Engine(store, Catalog(f"sqlite:///{tmp_path / db}"), config)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        with contextlib.suppress(Exception):  # already closed by the test
            engine.close()
