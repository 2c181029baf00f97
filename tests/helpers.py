"""Deterministic trajectories for tests: the content follows from the id alone."""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

from r3store.engine import Engine, EngineConfig
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import ObjectStore
from r3store.testing.synthetic import uniform_topk

SPEC = RouteSpec(num_layers=4, num_experts=64, top_k=4)


def seed_of(trajectory_id: str) -> int:
    return int.from_bytes(hashlib.sha256(trajectory_id.encode()).digest()[:8], "little")


def make_write(
    trajectory_id: str, spec: RouteSpec = SPEC, tokens: int | None = None, **meta: object
) -> TrajectoryWrite:
    rng = np.random.default_rng(seed_of(trajectory_id))
    num_tokens = tokens or int(rng.integers(20, 300))
    ids = uniform_topk(rng, num_tokens - 1, spec.num_layers, spec.num_experts, spec.top_k)
    return TrajectoryWrite(trajectory_id, num_tokens, topk=ids, **meta)  # type: ignore[arg-type]


def expected_ids(write: TrajectoryWrite, spec: RouteSpec = SPEC) -> np.ndarray:
    """What a read must return: sorted sets (or the order given), the last row empty."""
    ids = np.asarray(write.topk).astype(np.int16)
    if not spec.ordered:
        ids = np.sort(ids, axis=-1)
    empty = np.full((1, *ids.shape[1:]), -1, dtype=np.int16)
    return np.concatenate([ids, empty])


def assert_reads_back(
    engine: Engine, writes: Mapping[str, TrajectoryWrite], namespace: str = "ns"
) -> None:
    """Every one of `writes` (by trajectory id) reads back from `engine` as written."""
    batch = engine.get_batch(namespace, list(writes))
    assert batch.missing == []
    for tid, item in zip(writes, batch.items, strict=True):
        assert item is not None
        assert item.routes is not None
        assert np.array_equal(item.routes.to_topk(), expected_ids(writes[tid]))


def run_and_kill(script: Path, args: list[str], seconds: float) -> str:
    """Run a test child process until it prints READY, SIGKILL it `seconds` later, and
    return what it printed."""
    here = str(Path(__file__).parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([here, os.environ.get("PYTHONPATH", "")])}
    with subprocess.Popen(
        [sys.executable, str(script), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=env,
    ) as child:
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"READY"
            time.sleep(seconds)
            child.send_signal(signal.SIGKILL)
            return child.stdout.read().decode()
        finally:
            child.kill()


class MakeEngine:
    """Engines over a SQLite catalog in `directory`, closed at the end of the test."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.engines: list[Engine] = []
        self.catalogs: list[Catalog] = []

    def url(self, db: str = "catalog.db") -> str:
        return f"sqlite:///{self.directory / db}"

    def __call__(
        self, store: ObjectStore, config: EngineConfig | None = None, db: str = "catalog.db"
    ) -> Engine:
        engine = Engine(store, Catalog(self.url(db)), config)
        self.engines.append(engine)
        return engine

    def catalog(self, db: str = "catalog.db") -> Catalog:
        """The engines' catalog, opened again: a look behind their back."""
        catalog = Catalog(self.url(db))
        self.catalogs.append(catalog)
        return catalog

    def close(self) -> None:
        for engine in self.engines:
            with contextlib.suppress(Exception):  # already closed by the test
                engine.close()
        for catalog in self.catalogs:
            catalog.close()


def eventually(condition: Callable[[], object], what: str, within: float = 20.0) -> None:
    """Wait until `condition()` is true, asking every 0.5 s, at most `within` seconds
    (then fail naming `what`): a state to be reached, not a time to sleep."""
    deadline = time.monotonic() + within
    while not condition():
        assert time.monotonic() < deadline, f"not within {within:g} s: {what}"
        time.sleep(0.5)
