"""The engine against a plain model of what it should hold (`r3store.testing.engine_machine`),
over the local store and a SQLite catalog."""

from __future__ import annotations

from pathlib import Path

from r3store.engine import Engine
from r3store.policy import NamespaceSettings
from r3store.records import TrajectoryWrite
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore
from r3store.testing.engine_machine import SPEC, engine_machine, routes

TestEngineMachine = engine_machine().TestCase


def test_checkpoint_again_after_resume(tmp_path: Path) -> None:
    """Resumed to step 1, nothing consumed since: step 1 again is the same checkpoint."""
    engine = Engine(LocalStore(tmp_path / "objects"), Catalog(f"sqlite:///{tmp_path / 'c.db'}"))
    try:
        engine.namespaces.create("ns", SPEC, NamespaceSettings())
        engine.put("ns", [TrajectoryWrite("t0", 2, topk=routes("t0", 2))])
        first = engine.consumption.checkpoint("ns", 1)
        engine.sample("ns", 1)
        engine.consumption.resume("ns", 1)
        assert engine.consumption.checkpoint("ns", 1).consumed == first.consumed
    finally:
        engine.close()
