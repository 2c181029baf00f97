"""A real r3store server over HTTP (its own process, on a free port, the embedded store),
and the agreement figures the tests measured, printed at the end of the run."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from r3store.testing.service import start_server, stop_server
from r3store_client import Client

FIGURES: list[str] = []


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
def figures() -> list[str]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("routes: vLLM against the HF model")
        for line in FIGURES:
            terminalreporter.write_line(line)
