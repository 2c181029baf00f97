"""Hostile direct writes against a real server on SeaweedFS (`r3store.testing.direct_fuzz`):
forged, foreign and replayed plans, blobs that lie, spans and streams that do not fit,
bad metadata, beside valid controls. Counts of acknowledged bad rows (including rows a
refused commit left where a rebuild would find them), 5xx answers and server deaths
(goal: 0, 0, 0), and of controls read back as written.
"""

from __future__ import annotations

import time

from bench.figures import Figure
from r3store.testing.direct_fuzz import run as campaign
from r3store.testing.seaweedfs import SeaweedFS


def run(
    seaweed: SeaweedFS, cases: int = 2000, seed: int = 1
) -> tuple[list[Figure], dict[str, object]]:
    """`cases` direct-commit cases (`--quick`: a few hundred is plenty), and the
    campaign's counts by kind of case and by answer status, and its first failures."""
    started = time.perf_counter()
    report = campaign(seaweed, cases, seed)
    seconds = time.perf_counter() - started
    detail = {
        "cases": report.cases,
        "bad_acks": report.bad_acks,
        "server_errors": report.server_errors,
        "deaths": report.deaths,
        "setup_failures": report.setup_failures,
        "by_kind": dict(report.by_kind),
        "statuses": dict(report.statuses),
        "failures": report.failures[:20],
    }
    figures = [
        Figure("direct-commit fuzz: cases", report.cases, "cases"),
        Figure("direct-commit fuzz: refused 4xx, nothing readable", report.rejected, "cases"),
        Figure(
            "direct-commit fuzz: controls acknowledged and read back",
            report.controls_ok,
            "cases",
            target=f"= {report.controls}",
        ),
        Figure("direct-commit fuzz: acknowledged bad rows", report.bad_acks, "rows", target="0"),
        Figure("direct-commit fuzz: 5xx answers", report.server_errors, "cases", target="0"),
        Figure("direct-commit fuzz: server deaths", report.deaths, "cases", target="0"),
        Figure("direct-commit fuzz: rate", report.cases / seconds, "cases/s"),
    ]
    return figures, detail
