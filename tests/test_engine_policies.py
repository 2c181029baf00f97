"""Multi-turn appends, staleness, sampling and namespace control in the engine."""

from __future__ import annotations

import collections
from pathlib import Path

import numpy as np
import pytest

from helpers import SPEC, MakeEngine, expected_ids, make_write
from r3store.engine import Engine
from r3store.errors import Conflict, InvalidInput, NotFound, StalePolicy
from r3store.logic.sampling import Strategy
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.storage.store import LocalStore


@pytest.fixture
def engine(tmp_path: Path, make_engine: MakeEngine) -> Engine:
    made: Engine = make_engine(LocalStore(tmp_path / "objects"))
    made.namespaces.create("ns", SPEC)
    return made


def segment(tid: str, start: int, tokens: int, version: int, **meta: object) -> TrajectoryWrite:
    base = make_write(f"{tid}@{start}", tokens=tokens)
    return TrajectoryWrite(tid, tokens, topk=base.topk, start=start, policy_version=version, **meta)  # type: ignore[arg-type]


def test_multi_turn_append(engine: Engine) -> None:
    first = segment("chat", 0, 30, 1, group_id="g", prompt_len=10)
    second = segment("chat", 30, 20, 2)
    third = segment("chat", 50, 5, 3)
    assert engine.put("ns", [first])[0].created
    assert [r.created for r in engine.put("ns", [second, third])] == [True, True]
    item = engine.get_batch("ns", ["chat"]).items[0]
    assert item is not None
    assert (item.num_tokens, item.prompt_len, item.group_id, item.policy_version) == (
        55,
        10,
        "g",
        1,
    )
    assert [(s.start, s.num_tokens, s.policy_version) for s in item.segments] == [
        (0, 30, 1),
        (30, 20, 2),
        (50, 5, 3),
    ]
    want = np.concatenate([expected_ids(w) for w in (first, second, third)])
    assert np.array_equal(item.routes.to_topk(), want)
    # retries are idempotent, a different turn at a stored start is a conflict
    assert not engine.put("ns", [second])[0].created
    with pytest.raises(Conflict):
        engine.put("ns", [segment("chat", 30, 20, 9)])
    # appends must start where the trajectory ends
    with pytest.raises(InvalidInput, match="token 55"):
        engine.put("ns", [segment("chat", 60, 5, 3)])
    with pytest.raises(InvalidInput, match="not stored"):
        engine.put("ns", [segment("nobody", 10, 5, 3)])
    with pytest.raises(InvalidInput, match="group id"):
        engine.put("ns", [segment("chat", 55, 5, 3, group_id="other")])
    assert engine.get_batch("ns", ["chat"]).items[0].segments[-1].start == 50


def test_whole_conversation_in_one_put(engine: Engine) -> None:
    turns = [segment("c2", 0, 12, 4, group_id="h"), segment("c2", 12, 8, 5)]
    engine.put("ns", list(reversed(turns)))
    item = engine.get_batch("ns", ["c2"]).items[0]
    assert item is not None
    assert item.num_tokens == 20
    assert item.group_id == "h"


def test_staleness_window(engine: Engine) -> None:
    engine.namespaces.update_settings("ns", NamespaceSettings(max_policy_lag=1))
    engine.put("ns", [make_write("v0", policy_version=0), make_write("v1", policy_version=1)])
    engine.namespaces.set_policy_version("ns", 2)
    with pytest.raises(StalePolicy):
        engine.put("ns", [make_write("old", policy_version=0)])
    engine.put("ns", [make_write("ok", policy_version=1)])
    batch = engine.get_batch("ns", ["v0", "v1", "gone"])
    assert batch.stale == ["v0"]
    assert batch.missing == ["gone"]
    assert batch.items[0] is None
    assert batch.items[1] is not None
    assert engine.get_batch("ns", ["v0"], include_stale=True).items[0] is not None
    with pytest.raises(InvalidInput):
        engine.namespaces.set_policy_version("ns", 1)
    assert engine.namespaces.get("ns").policy_version == 2


def test_fifo_sampling_with_max_times(engine: Engine) -> None:
    engine.namespaces.update_settings("ns", NamespaceSettings(max_times_sampled=2))
    for i in range(6):
        engine.put("ns", [make_write(f"f{i}")])
    first = engine.sample("ns", 4, Strategy.FIFO)
    assert first.ids == ["f0", "f1", "f2", "f3"]
    assert all(item is not None for item in first.items)
    assert engine.sample("ns", 4).ids == ["f0", "f1", "f2", "f3"]
    assert engine.sample("ns", 4).ids == ["f4", "f5"]  # f0-f3 reached max_times_sampled
    assert engine.sample("ns", 4).ids == ["f4", "f5"]
    assert engine.sample("ns", 4).ids == []


def test_uniform_sampling_is_uniform(engine: Engine) -> None:
    engine.put("ns", [make_write(f"u{i}") for i in range(10)])
    counts: collections.Counter[str] = collections.Counter()
    for seed in range(300):
        counts.update(engine.sample("ns", 2, Strategy.UNIFORM, decode=False, seed=seed).ids)
    # 600 draws over 10 ids: 60 expected each; a 4-sigma band is about +-29
    assert set(counts) == {f"u{i}" for i in range(10)}
    assert all(31 <= c <= 89 for c in counts.values()), counts


def test_group_sampling_keeps_groups_whole(engine: Engine) -> None:
    writes = [make_write(f"g{g}-{i}", group_id=f"g{g}") for g in range(5) for i in range(3)]
    engine.put("ns", writes)
    for strategy in Strategy:
        batch = engine.sample("ns", 7, strategy, whole_groups=True, decode=False, seed=1)
        groups = collections.Counter(tid.split("-")[0] for tid in batch.ids)
        assert set(groups.values()) == {3}, groups
        assert len(batch.ids) == 6


def test_namespace_settings_and_delete(engine: Engine, tmp_path: Path) -> None:
    settings = NamespaceSettings(
        max_policy_lag=3, max_times_sampled=1, retention=Retention(keep_versions=2, ttl_seconds=60)
    )
    assert engine.namespaces.update_settings("ns", settings).settings == settings
    assert engine.namespaces.get("ns").settings == settings
    engine.put("ns", [make_write("x")])
    assert [n.name for n in engine.namespaces.all()] == ["ns"]
    deleted = engine.namespaces.delete("ns")
    assert deleted == 2  # one shard and the manifest
    assert not any((tmp_path / "objects").rglob("*.parquet"))
    with pytest.raises(NotFound):
        engine.namespaces.get("ns")
    with pytest.raises(NotFound):
        engine.get_batch("ns", ["x"])
    engine.namespaces.create("ns", SPEC)
    assert engine.get_batch("ns", ["x"]).missing == ["x"]


def test_token_ids_round_trip(engine: Engine) -> None:
    base = make_write("tok", tokens=40)
    tokens = np.arange(1000, 1040)
    engine.put("ns", [TrajectoryWrite("tok", 40, topk=base.topk, token_ids=tokens)])
    engine.put("ns", [segment("tok", 40, 10, 0)])  # a turn sent without token ids
    item = engine.get_batch("ns", ["tok"]).items[0]
    assert item is not None
    assert item.token_ids is not None
    assert np.array_equal(item.token_ids[:40], tokens)
    assert (item.token_ids[40:] == -1).all()
    for bad in (np.arange(39), np.array([-1] * 40), np.zeros(40, np.float32)):
        with pytest.raises(InvalidInput, match="token"):
            engine.put("ns", [TrajectoryWrite("bad", 40, topk=base.topk, token_ids=bad)])
    retry = TrajectoryWrite("tok", 40, topk=base.topk, token_ids=tokens + 1)
    with pytest.raises(Conflict):
        engine.put("ns", [retry])
