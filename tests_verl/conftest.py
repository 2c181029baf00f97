"""A real r3store server over HTTP (its own process, on a free port, the embedded store),
and namespaces for verl's routes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from verl_rollout import make_namespace

from r3store.testing.service import start_server, stop_server
from r3store_client import Client


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    process, url = start_server(Path(tmp_path_factory.mktemp("r3store")))
    try:
        yield url
    finally:
        stop_server(process)


@pytest.fixture
def client(server: str) -> Iterator[Client]:
    with Client(server) as c:
        yield c


@pytest.fixture
def namespace(client: Client) -> str:
    """A fresh namespace for the tiny model's routes that keeps the engine's top-k order,
    as verl's tensor keeps it."""
    return make_namespace(client, ordered=True)
