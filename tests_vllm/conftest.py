"""The r3store server and client (`served`, from tests/),
and the agreement figures the tests measured, printed at the end of the run."""

from __future__ import annotations

import pytest

pytest_plugins = ["served"]

FIGURES: list[str] = []


@pytest.fixture
def figures() -> list[str]:
    return FIGURES


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if FIGURES:
        terminalreporter.section("routes: vLLM against the trainers")
        for line in FIGURES:
            terminalreporter.write_line(line)
