"""The Arrow IPC wire formats round-trip, and bad bodies are refused clearly."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from helpers import SPEC, expected_ids, make_write
from r3store.engine import Engine
from r3store.errors import InvalidInput, InvalidRoutes
from r3store.logic.routes import to_mask
from r3store.protocol.wire import (
    ReadFormat,
    decode_batch,
    decode_writes,
    encode_batch,
    encode_writes,
)
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore
from r3store.testing.synthetic import uniform_topk


def test_writes_round_trip() -> None:
    a = make_write("a", group_id="g", prompt_len=4, policy_version=3)
    routes = Engine.prepare_routes(SPEC, make_write("b"))
    b = TrajectoryWrite("b", routes.num_tokens, mask=to_mask(routes, SPEC), start=0)
    c = TrajectoryWrite(
        "c",
        5,
        topk=np.asarray(make_write("c", tokens=5).topk).astype(np.uint8),
        token_ids=np.arange(5),
    )
    back = decode_writes(encode_writes([a, b, c]), SPEC)
    assert [w.trajectory_id for w in back] == ["a", "b", "c"]
    assert (back[0].group_id, back[0].prompt_len, back[0].policy_version) == ("g", 4, 3)
    assert np.array_equal(back[0].topk, a.topk)
    assert np.array_equal(back[1].mask, b.mask)
    assert back[1].group_id is None
    assert back[2].topk.dtype == np.uint8
    assert np.array_equal(back[2].token_ids, np.arange(5))


def test_bad_upload_bodies() -> None:
    with pytest.raises(InvalidInput, match="not an Arrow IPC stream"):
        decode_writes(b'{"json": true}', SPEC)
    good = encode_writes([make_write("a")])
    with pytest.raises(InvalidInput):
        decode_writes(good[: len(good) // 2], SPEC)
    table = pa.table({"trajectory_id": ["x"], "num_tokens": [3]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    with pytest.raises(InvalidInput, match="'routes'"):
        decode_writes(sink.getvalue().to_pybytes(), SPEC)
    odd = pa.table({"trajectory_id": ["x"], "num_tokens": [3], "routes": [b"\x00" * 7]})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, odd.schema) as w:
        w.write_table(odd)
    with pytest.raises(InvalidRoutes, match="not whole values"):
        decode_writes(sink.getvalue().to_pybytes(), SPEC)


def test_a_wrong_layer_count_is_named() -> None:
    """[T, 4, 8] ids sent to a 48-layer namespace: the error is the layer count's."""
    spec = RouteSpec(48, 128, 8)
    ids = uniform_topk(np.random.default_rng(0), 100, 4, 128, 8)
    body = encode_writes([TrajectoryWrite("t", 100, topk=ids)])
    with pytest.raises(InvalidRoutes) as caught:
        decode_writes(body, spec)
    message = str(caught.value)
    assert "[100, 4, 8] (the layer count differs)" in message
    assert "token count" not in message
    assert "expected [100 or 99, 48, 8]" in message
    wide = uniform_topk(np.random.default_rng(0), 99, 48, 128, 4)
    with pytest.raises(InvalidRoutes, match=r"\[99, 48, 4\] \(top_k differs\)"):
        decode_writes(encode_writes([TrajectoryWrite("t", 100, topk=wide)]), spec)


@pytest.mark.parametrize("fmt", list(ReadFormat))
def test_batches_round_trip(tmp_path: Path, fmt: ReadFormat) -> None:
    with Engine(LocalStore(tmp_path / "o"), Catalog(f"sqlite:///{tmp_path / 'c.db'}")) as engine:
        engine.namespaces.create("ns", SPEC)
        writes = [make_write(f"t{i}", group_id="g") for i in range(3)]
        engine.put("ns", writes)
        more = make_write("t1-turn2", tokens=9)
        engine.put(
            "ns",
            [
                TrajectoryWrite(
                    "t1", 9, topk=more.topk, start=writes[1].num_tokens, token_ids=np.arange(9)
                )
            ],
        )
        stored = engine.get_batch("ns", ["t2", "nope", "t1", "t0"], decode=False)
        spec, batch = decode_batch(encode_batch(stored, SPEC, fmt))
    assert spec == SPEC
    assert batch.ids == ["t2", "nope", "t1", "t0"]
    assert batch.missing == ["nope"]
    assert batch.items[1] is None
    t2, t1 = batch.items[0], batch.items[2]
    assert np.array_equal(t2.routes.to_topk(), expected_ids(writes[2]))
    want = np.concatenate([expected_ids(writes[1]), expected_ids(more)])
    assert np.array_equal(t1.routes.to_topk(), want)
    assert [s.start for s in t1.segments] == [0, writes[1].num_tokens]
    assert (t1.token_ids[: writes[1].num_tokens] == -1).all()
    assert np.array_equal(t1.token_ids[writes[1].num_tokens :], np.arange(9))
