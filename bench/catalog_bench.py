"""Catalog lookups and batch reads with SQLite and PostgreSQL side by side, and the
object store's bytes after retention against the live bytes."""

from __future__ import annotations

import tempfile
import uuid
from pathlib import Path

from bench.engine_bench import READ_BATCH, SPEC, Workload
from bench.figures import Figure, median_of, timed
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.storage.keys import SHARD_PREFIX
from r3store.storage.store import LocalStore
from r3store.testing import postgres


def _fill(engine: Engine, work: Workload) -> None:
    engine.namespaces.create("bench", SPEC)
    for start in range(0, len(work.ids), 16):
        engine.put(
            "bench",
            [
                TrajectoryWrite(
                    tid, work.tokens, topk=work.routes(start + i), policy_version=(start + i) % 4
                )
                for i, tid in enumerate(work.ids[start : start + 16])
            ],
        )


def _measure(engine: Engine, catalog: Catalog, work: Workload) -> dict[str, float]:
    batches = [work.ids[i : i + READ_BATCH] for i in range(0, len(work.ids), READ_BATCH)]

    def lookups() -> None:
        for b in batches * 10:
            catalog.segments.lookup("bench", b)

    def reads() -> None:
        for b in batches:
            engine.get_batch("bench", b)

    return {
        "lookups": len(batches) * 10 * READ_BATCH / median_of(3, lambda: timed(lookups)),
        "read": work.token_layers / median_of(3, lambda: timed(reads)) / 1e6,
    }


def run(count: int = 128, tokens: int = 2048) -> list[Figure]:
    work = Workload(count, tokens)
    tmp = Path(tempfile.mkdtemp(prefix="r3store-catalog-"))
    figures = []
    results: dict[str, dict[str, float]] = {}
    with postgres.running() as pg:
        urls = {
            "SQLite": f"sqlite:///{tmp / 'c.db'}",
            "PostgreSQL": pg.database(f"bench_{uuid.uuid4().hex[:8]}"),
        }
        for label, url in urls.items():
            catalog = Catalog(url)
            engine = Engine(LocalStore(tmp / f"objects-{label}"), catalog)
            try:
                _fill(engine, work)
                results[label] = _measure(engine, catalog, work)
            finally:
                engine.close()
    for key, unit, name in (
        ("lookups", "ids/s", "catalog lookups, batches of 32 ids"),
        ("read", "M token-layers/s", "batch read, local store"),
    ):
        figures.append(
            Figure(
                f"{name}: PostgreSQL",
                results["PostgreSQL"][key],
                unit,
                results["SQLite"][key],
                "SQLite",
            )
        )

    # retention: keep the last policy version of four, compact, collect
    store = LocalStore(tmp / "retention")
    engine = Engine(store, Catalog(f"sqlite:///{tmp / 'r.db'}"))
    try:
        _fill(engine, work)
        before = sum(o.size for o in store.list(SHARD_PREFIX))
        engine.namespaces.update_settings(
            "bench", NamespaceSettings(retention=Retention(keep_versions=1))
        )
        engine.namespaces.set_policy_version("bench", 3)
        report = engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
        after = sum(o.size for o in store.list(SHARD_PREFIX))
    finally:
        engine.close()
    figures.append(
        Figure(
            "object store bytes after retention (keep 1 of 4 versions)",
            after / 2**20,
            "MiB",
            report.live_bytes / 2**20,
            "live route bytes",
        )
    )
    figures.append(Figure("object store bytes before retention", before / 2**20, "MiB"))
    return figures
