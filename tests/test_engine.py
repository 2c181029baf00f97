"""The engine: concurrent durable writes, idempotency, conflicts, backpressure, reads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from helpers import SPEC, MakeEngine, expected_ids, make_write
from r3store.engine import Engine, EngineConfig
from r3store.engine.writer import WriterConfig
from r3store.errors import Backpressure, Conflict, InvalidInput, InvalidRoutes, NotFound, StoreError
from r3store.logic.routes import to_mask
from r3store.logic.writes import encode_write
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore, ObjectStore


def snapshot(store: ObjectStore, make_engine: MakeEngine) -> tuple[list[str], int]:
    """Every object in the store, and the trajectories the catalog holds: read behind
    the engine's back."""
    return [o.key for o in store.list("")], make_engine.catalog().segments.count("ns")


def test_sixteen_writers_then_restart(store: ObjectStore, make_engine: MakeEngine) -> None:
    engine = make_engine(store, EngineConfig(writer=WriterConfig(commit_interval=0.02)))
    engine.namespaces.create("ns", SPEC)
    acked: dict[str, TrajectoryWrite] = {}
    lock = threading.Lock()

    def writer(w: int) -> None:
        for n in range(6):
            batch = [make_write(f"w{w}-{n}-{i}", group_id=f"w{w}") for i in range(1 + n % 3)]
            engine.put("ns", batch)
            with lock:
                acked.update((b.trajectory_id, b) for b in batch)

    with ThreadPoolExecutor(16) as pool:
        list(pool.map(writer, range(16)))
    puts = 16 * 6
    shards = len(list(store.list("shards/")))
    assert shards < puts, "concurrent puts share shards (group commit)"

    def check(eng: Engine) -> None:
        ids = sorted(acked)
        batch = eng.get_batch("ns", ids)
        assert batch.missing == []
        for tid, item in zip(ids, batch.items, strict=True):
            assert item is not None
            assert item.trajectory_id == tid
            assert item.num_tokens == acked[tid].num_tokens
            assert np.array_equal(item.routes.to_topk(), expected_ids(acked[tid]))

    check(engine)
    engine.close()
    reopened = make_engine(store)
    check(reopened)


def test_reads_keep_order_and_name_missing(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = make_engine(LocalStore(tmp_path / "o"))
    engine.namespaces.create("ns", SPEC)
    writes = [make_write(f"t{i}", prompt_len=3, policy_version=2) for i in range(5)]
    engine.put("ns", writes)
    ids = ["t3", "ghost", "t0", "t3", "other"]
    batch = engine.get_batch("ns", ids)
    assert batch.missing == ["ghost", "other"]
    assert [i.trajectory_id if i else None for i in batch.items] == ["t3", None, "t0", "t3", None]
    assert batch.lengths == [
        writes[3].num_tokens,
        None,
        writes[0].num_tokens,
        writes[3].num_tokens,
        None,
    ]
    assert batch.items[0].prompt_len == 3
    assert batch.items[0].policy_version == 2
    encoded = engine.get_batch("ns", ["t1"], decode=False).items[0]
    assert encoded.routes is None
    assert encoded.segments[0].encoded is not None
    with pytest.raises(NotFound):
        engine.get("ns", "ghost")
    with pytest.raises(NotFound):
        engine.get_batch("nope", ["t1"])


def test_retries_are_idempotent_and_conflicts_refused(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    first = make_write("a", group_id="g")
    assert [r.created for r in engine.put("ns", [first])] == [True]
    before = snapshot(store, make_engine)
    assert [r.created for r in engine.put("ns", [first])] == [False]
    assert snapshot(store, make_engine) == before, "a retry stores no second copy"

    other_routes = make_write("b")
    clash = TrajectoryWrite("a", other_routes.num_tokens, topk=other_routes.topk, group_id="g")
    with pytest.raises(Conflict):
        engine.put("ns", [clash])
    other_meta = TrajectoryWrite("a", first.num_tokens, topk=first.topk, group_id="h")
    with pytest.raises(Conflict):
        engine.put("ns", [make_write("c"), other_meta])
    assert snapshot(store, make_engine) == before, "a conflicting put changes nothing"
    assert np.array_equal(engine.get("ns", "a").to_topk(), expected_ids(first))


def test_racing_puts_of_one_id_store_it_once(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = make_engine(
        LocalStore(tmp_path / "o"), EngineConfig(writer=WriterConfig(commit_interval=0.2))
    )
    engine.namespaces.create("ns", SPEC)
    same = make_write("x")
    other = make_write("y")
    clash = TrajectoryWrite("x", other.num_tokens, topk=other.topk)
    outcomes: list[object] = []

    def put(write: TrajectoryWrite) -> None:
        try:
            outcomes.append(engine.put("ns", [write])[0].created)
        except Conflict:
            outcomes.append("conflict")

    threads = [threading.Thread(target=put, args=(w,)) for w in (same, same, clash)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert make_engine.catalog().segments.count("ns") == 1
    stored = engine.get("ns", "x").to_topk()
    winner = same if np.array_equal(stored, expected_ids(same)) else clash
    if winner is same:
        assert sorted(map(str, outcomes)) == sorted(["False", "True", "conflict"])
    else:
        assert sorted(map(str, outcomes)) == sorted(["conflict", "conflict", "True"])


def _bad_ids(edit: Callable[[npt.NDArray[Any]], object]) -> npt.NDArray[Any]:
    ids = np.asarray(make_write("good", tokens=11).topk).copy()
    edit(ids)
    return ids


def _mask(edit: Callable[[npt.NDArray[Any]], object]) -> npt.NDArray[Any]:
    from r3store.engine import Engine

    routes = Engine.prepare_routes(SPEC, make_write("good", tokens=11))
    mask = to_mask(routes, SPEC)[:-1].copy()
    edit(mask)
    return mask


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"topk": np.zeros((10, 4, 4), np.int32)}, InvalidRoutes),  # duplicates
        ({"topk": _bad_ids(lambda a: a.__setitem__((3, 1, 2), 64))}, InvalidRoutes),
        ({"topk": _bad_ids(lambda a: a.__setitem__((3, 1, 2), -5))}, InvalidRoutes),
        ({"topk": _bad_ids(lambda a: a.__setitem__((3, 1, 2), -1))}, InvalidRoutes),  # fewer
        ({"topk": np.zeros((10, 4, 3), np.int32)}, InvalidRoutes),  # shape
        ({"topk": np.zeros((10, 4, 4), np.float32)}, InvalidRoutes),  # dtype
        ({"topk": None, "mask": _mask(lambda m: m.__setitem__((2, 0, 0), 0b111))}, InvalidRoutes),
        ({"topk": None, "mask": _mask(lambda m: m.__setitem__((2, 0, 0), 0))}, InvalidRoutes),
        ({"topk": None, "mask": np.zeros((10, 4, 7), np.uint8)}, InvalidRoutes),
        ({"num_tokens": 7}, InvalidRoutes),  # rows do not match
        ({"trajectory_id": ""}, InvalidInput),
        ({"trajectory_id": "bad\nid"}, InvalidInput),
        ({"prompt_len": 10_000}, InvalidInput),
        ({"policy_version": -1}, InvalidInput),
        ({"mask": np.zeros((1, 4, 8), np.uint8)}, InvalidInput),  # both forms given
    ],
)
def test_bad_input_changes_nothing(
    store: ObjectStore, make_engine: MakeEngine, change: dict[str, object], error: type
) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    engine.put("ns", [make_write("keep")])
    before = snapshot(store, make_engine)
    good = make_write("good", tokens=11)
    fields = {**good.__dict__, **change}
    with pytest.raises(error):
        engine.put("ns", [make_write("also-good"), TrajectoryWrite(**fields)])
    assert snapshot(store, make_engine) == before
    assert engine.get_batch("ns", ["also-good"]).missing == ["also-good"]


def test_masks_and_ordered_namespaces(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = make_engine(LocalStore(tmp_path / "o"))
    engine.namespaces.create("ns", SPEC)
    ordered = RouteSpec(4, 64, 4, ordered=True)
    engine.namespaces.create("ordered", ordered)
    write = make_write("m")
    routes_mask = to_mask(engine.prepare_routes(SPEC, write), SPEC)
    engine.put("ns", [TrajectoryWrite("m", write.num_tokens, mask=routes_mask)])
    assert np.array_equal(engine.get("ns", "m").to_topk(), expected_ids(write))
    engine.put("ordered", [write])
    assert np.array_equal(engine.get("ordered", "m").to_topk(), expected_ids(write, ordered))
    with pytest.raises(InvalidRoutes, match="keeps the top-k order"):
        engine.put("ordered", [TrajectoryWrite("m2", write.num_tokens, mask=routes_mask)])
    # routes whose producer promises no slot order: an ordered namespace refuses them,
    # as ids or encoded; an unordered one stores their sets; "verbatim" keeps them
    unranked = replace(write, trajectory_id="u", slot_order="set", producer="vLLM")
    encoded = replace(encode_write(replace(unranked, slot_order="rank"), ordered), slot_order="set")
    for refused in (unranked, encoded):
        with pytest.raises(InvalidRoutes, match=r"^u: vLLM promises no order .* ordered=False"):
            engine.put("ordered", [refused])
    assert engine.get_batch("ordered", ["u"]).missing == ["u"]
    engine.put("ns", [unranked])
    assert np.array_equal(engine.get("ns", "u").to_topk(), expected_ids(write))
    engine.put("ordered", [replace(unranked, slot_order="verbatim")])
    assert np.array_equal(engine.get("ordered", "u").to_topk(), expected_ids(write, ordered))
    with pytest.raises(InvalidInput):
        engine.put("Bad Name!", [write])
    with pytest.raises(NotFound):
        engine.put("unknown", [write])


class SlowStore(LocalStore):
    """A local store whose create-only puts take `delay` seconds, or fail when `broken`."""

    delay = 0.0
    broken = False

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        time.sleep(self.delay)
        if self.broken and key.startswith("shards/"):
            raise StoreError("the store is down")
        super().put_if_absent(key, data)


def test_full_buffer_pushes_back(tmp_path: Path, make_engine: MakeEngine) -> None:
    store = SlowStore(tmp_path / "o")
    config = EngineConfig(
        writer=WriterConfig(buffer_bytes=1, put_timeout=0.2, commit_interval=0.01)
    )
    engine = make_engine(store, config)
    engine.namespaces.create("ns", SPEC)
    store.delay = 1.0
    results: dict[str, object] = {}

    def put(tid: str) -> None:
        try:
            results[tid] = engine.put("ns", [make_write(tid)])[0].created
        except Backpressure as exc:
            results[tid] = exc

    threads = [threading.Thread(target=put, args=(f"p{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    pushed = [tid for tid, r in results.items() if isinstance(r, Backpressure)]
    acked = [tid for tid, r in results.items() if r is True]
    assert pushed, results
    assert acked, results
    assert all(r.retry_after > 0 for r in results.values() if isinstance(r, Backpressure))
    store.delay = 0.0
    assert engine.get_batch("ns", acked).missing == []
    assert engine.get_batch("ns", pushed).missing == pushed


def test_store_failure_acknowledges_nothing(tmp_path: Path, make_engine: MakeEngine) -> None:
    store = SlowStore(tmp_path / "o")
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    store.broken = True
    with pytest.raises(StoreError):
        engine.put("ns", [make_write("lost")])
    assert make_engine.catalog().segments.count("ns") == 0
    store.broken = False
    assert engine.put("ns", [make_write("lost")])[0].created
    assert make_engine.catalog().segments.count("ns") == 1


def test_engine_on_a_fresh_catalog_sees_nothing_until_rebuilt(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "o")
    with Engine(store, Catalog(f"sqlite:///{tmp_path / 'a.db'}")) as engine:
        engine.namespaces.create("ns", SPEC)
        engine.put("ns", [make_write("t")])
    other = Engine(LocalStore(tmp_path / "o"), Catalog(f"sqlite:///{tmp_path / 'b.db'}"))
    with other, pytest.raises(NotFound):
        other.get_batch("ns", ["t"])
