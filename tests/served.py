"""The r3store server and client fixtures of the framework suites (tests_verl/,
tests_vllm/, each in an environment of its own): a real server over HTTP, its own
process on a free port, the embedded store, one for the whole run. Their conftests
load this module as a plugin (`pytest_plugins`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

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
