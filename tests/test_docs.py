"""The code in the README and docs/format.md runs as written."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_engine_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    [block] = python_blocks(ROOT / "README.md")
    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    scope: dict[str, object] = {}
    exec(compile(block, "README.md", "exec"), scope)
    routes = scope["routes"]
    assert isinstance(routes, np.ndarray)
    assert routes.shape == (4096, 48, 8)
    assert (routes[-1] == -1).all()


def test_format_decoding_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3store.catalog import Catalog
    from r3store.engine import Engine
    from r3store.records import TrajectoryWrite
    from r3store.spec import RouteSpec
    from r3store.store import LocalStore
    from r3store.testing.synthetic import uniform_topk

    ids = uniform_topk(np.random.default_rng(5), 99, 48, 128, 8)
    with Engine(LocalStore(tmp_path / "o"), Catalog(f"sqlite:///{tmp_path / 'c.db'}")) as engine:
        engine.create_namespace("ns", RouteSpec(48, 128, 8))
        engine.put("ns", [TrajectoryWrite("t", 100, topk=ids)])
    [shard] = list((tmp_path / "o" / "shards" / "ns").iterdir())
    shutil.copy(shard, tmp_path / "shard.parquet")
    [block] = python_blocks(ROOT / "docs" / "format.md")
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(block, "format.md", "exec"), scope)
    topk = scope["topk"]
    assert isinstance(topk, np.ndarray)
    assert np.array_equal(topk[:-1], np.sort(ids, axis=-1))
    assert (topk[-1] == -1).all()
