"""The code in docs/format.md runs as written (the README's: test_readme.py)."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).parent.parent


def python_blocks(path: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_format_decoding_example(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from r3store.engine import Engine
    from r3store.records import TrajectoryWrite
    from r3store.spec import RouteSpec
    from r3store.storage.catalog import Catalog
    from r3store.storage.store import LocalStore
    from r3store.testing.synthetic import uniform_topk

    ids = uniform_topk(np.random.default_rng(5), 99, 48, 128, 8)
    with Engine(LocalStore(tmp_path / "o"), Catalog(f"sqlite:///{tmp_path / 'c.db'}")) as engine:
        engine.namespaces.create("ns", RouteSpec(48, 128, 8))
        engine.put("ns", [TrajectoryWrite("t", 100, topk=ids)])
    [shard] = list((tmp_path / "o" / "shards" / "ns").iterdir())
    shutil.copy(shard, tmp_path / "shard.parquet")
    [block] = [b for b in python_blocks(ROOT / "docs" / "format.md") if "verify a digest" not in b]
    monkeypatch.chdir(tmp_path)
    scope: dict[str, object] = {}
    exec(compile(block, "format.md", "exec"), scope)
    topk = scope["topk"]
    assert isinstance(topk, np.ndarray)
    assert np.array_equal(topk[:-1], np.sort(ids, axis=-1))
    assert (topk[-1] == -1).all()
