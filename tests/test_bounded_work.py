"""What one request may make the service do is bounded: `/metrics` gathers off the event
loop and reads only the newest policy versions, uploads are bounded in rows, columns,
memory per row and policy versions ahead, answers in decoded size, parsing is linear,
and work stops once its request was answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import anyio
import numpy as np
import pyarrow as pa
import pytest
from prometheus_client.parser import text_string_to_metric_families

from helpers import SPEC, MakeEngine, make_write
from http_helpers import AppClient, auth, make_namespace, service, upload
from r3store.engine import Engine
from r3store.engine.encoding import Encoder
from r3store.engine.settling import settle_rows
from r3store.errors import StoreError
from r3store.logic import codec, stats
from r3store.policy import ENGINE
from r3store.protocol import wire
from r3store.protocol.wire import CONTENT_TYPE, ReadFormat, encode_batch, encode_writes
from r3store.records import Segment, TrajectoryWrite
from r3store.storage.store import LocalStore
from r3store_server.limits import Deadline


def one_token(tid: str, version: int = 0, layers: int = 4, width: int = 4) -> TrajectoryWrite:
    """A trajectory of two tokens, one routed: the cheapest row there is on the wire."""
    ids = np.arange(width, dtype=np.int8)[None, None, :].repeat(layers, axis=1)
    return TrajectoryWrite(tid, 2, topk=ids, policy_version=version)


def long_write(tid: str, tokens: int) -> TrajectoryWrite:
    """`tokens` tokens that all choose experts 0-3: a few KiB once compressed."""
    ids = np.broadcast_to(np.arange(4, dtype=np.int8), (tokens - 1, 4, 4)).copy()
    return TrajectoryWrite(tid, tokens, topk=ids)


def error(response: Any, status: int, code: str) -> str:
    assert response.status_code == status, response.text
    body = response.json()["error"]
    assert body["code"] == code, body
    message: str = body["message"]
    return message


def count(client: AppClient, ns: str = "ns") -> int:
    trajectories: int = client.get(f"/v1/namespaces/{ns}", headers=auth("admin")).json()[
        "trajectories"
    ]
    return trajectories


def body_of(table: pa.Table, max_chunksize: int | None = None) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        for batch in table.to_batches(max_chunksize=max_chunksize):
            writer.write_batch(batch)
    data: bytes = sink.getvalue().to_pybytes()
    return data


def send(client: AppClient, body: bytes, ns: str = "ns") -> Any:
    return client.post(
        f"/v1/namespaces/{ns}/trajectories",
        content=body,
        headers={**auth("writer"), "Content-Type": CONTENT_TYPE},
    )


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """How often the catalog's statistics blobs were unpacked, and routes decoded."""
    calls = {"unpack": 0, "decode": 0}
    unpack, decode = stats.unpack, codec.decode

    def counting_unpack(*args: Any, **kwargs: Any) -> Any:
        calls["unpack"] += 1
        return unpack(*args, **kwargs)

    def counting_decode(*args: Any, **kwargs: Any) -> Any:
        calls["decode"] += 1
        return decode(*args, **kwargs)

    monkeypatch.setattr(stats, "unpack", counting_unpack)
    monkeypatch.setattr(codec, "decode", counting_decode)
    return calls


# ---- item 3: /metrics, and policy versions ahead of the namespace's


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_scrapes_serve_gathered_gauges_and_a_gathering_reads_only_the_newest_versions(
    tmp_path: Path, counted: dict[str, int]
) -> None:
    versions = 300
    with service(tmp_path, None, metrics_interval=3600, max_policy_ahead=versions) as client:
        make_namespace(client)
        writes = [one_token(f"v{v}", version=v) for v in range(versions)]
        assert upload(client, writes).status_code == 200
        collector = client.app.state.metrics.namespaces
        for _ in range(200):  # the gathering at start is done (it found no namespace yet)
            if collector.gathered:
                break
            time.sleep(0.05)
        before = counted["unpack"]
        collector.refresh()  # what the background thread does every R3STORE_METRICS_INTERVAL
        assert counted["unpack"] - before <= 4, "a gathering read more than the newest versions"
        before = counted["unpack"]
        texts = [client.get("/metrics", headers=auth("admin")).text for _ in range(5)]
        assert counted["unpack"] == before, "a scrape read the catalog"
        gauges = samples(texts[-1])
        assert gauges["r3store_namespace_trajectories", (("namespace", "ns"),)] == versions
        experts = client.get("/v1/namespaces/ns/stats/experts", headers=auth("reader")).json()
        newest = experts["versions"][-1]
        assert newest["policy_version"] == versions - 1
        for layer, value in enumerate(newest["imbalance"]):
            labels = (("layer", str(layer)), ("namespace", "ns"), ("source", "engine"))
            assert gauges["r3store_expert_load_imbalance", labels] == pytest.approx(value)
        drift = client.get("/v1/namespaces/ns/stats/drift", headers=auth("reader")).json()
        last = drift["steps"][-1]
        assert (last["before"], last["after"]) == (versions - 2, versions - 1)
        for layer, value in enumerate(last["divergence"]):
            key = (("layer", str(layer)), ("namespace", "ns"))
            assert gauges["r3store_router_drift", key] == pytest.approx(value)


def test_the_background_gathering_stops_with_the_service(tmp_path: Path) -> None:
    with service(tmp_path, None, metrics_interval=0.05) as client:
        make_namespace(client)
        collector = client.app.state.metrics.namespaces
        thread = collector._thread
        assert thread.is_alive()
    assert not thread.is_alive()


def test_uploads_far_ahead_of_the_policy_version_are_refused(tmp_path: Path) -> None:
    with service(tmp_path, None) as client:  # R3STORE_MAX_POLICY_AHEAD: 16
        make_namespace(client)
        message = error(
            upload(client, [make_write("far", policy_version=17)]), 400, "invalid_input"
        )
        assert "R3STORE_MAX_POLICY_AHEAD" in message
        assert "16" in message
        assert "policy version 17" in message
        assert "current version 0" in message
        assert count(client) == 0
        assert upload(client, [make_write("near", policy_version=16)]).status_code == 200
        moved = client.put(
            "/v1/namespaces/ns/policy-version", json={"policy_version": 5}, headers=auth("admin")
        )
        assert moved.status_code == 200, moved.text
        assert upload(client, [make_write("next", policy_version=21)]).status_code == 200
        error(upload(client, [make_write("past", policy_version=22)]), 400, "invalid_input")
    with service(tmp_path / "none", None, max_policy_ahead=0) as client:
        make_namespace(client)
        error(upload(client, [make_write("a", policy_version=1)]), 400, "invalid_input")
        assert upload(client, [make_write("b", policy_version=0)]).status_code == 200


# ---- item 4: rows per upload, and the memory a row holds


def test_uploads_of_more_rows_than_the_limit_are_refused(tmp_path: Path) -> None:
    with service(tmp_path, None, max_upload_rows=50) as client:
        make_namespace(client)
        table = pa.ipc.open_stream(
            encode_writes([one_token(f"r{i}") for i in range(60)])
        ).read_all()
        message = error(send(client, body_of(table, max_chunksize=30)), 413, "payload_too_large")
        assert "50 rows" in message
        assert count(client) == 0
        assert send(client, body_of(table.slice(0, 50), max_chunksize=30)).status_code == 200
        assert count(client) == 50
        sink = pa.BufferOutputStream()
        with pa.ipc.new_stream(sink, table.schema) as writer:
            for _ in range(60):  # empty record batches: no row, but work each
                writer.write_batch(table.to_batches()[0].slice(0, 0))
            writer.write_batch(table.to_batches()[0].slice(55, 1))
        message = error(send(client, sink.getvalue().to_pybytes()), 413, "payload_too_large")
        assert "record batches" in message
        assert count(client) == 50


def test_the_memory_budget_charges_each_rows_expert_load(tmp_path: Path) -> None:
    # a row of 16 layers and 256 experts holds 8 KiB + 32 KiB while it is stored: 40 of
    # them (a 13 KiB body) need more than the whole 1 MiB budget
    settings = {"upload_memory_bytes": 1 << 20, "max_body_bytes": 128 << 10}
    with service(tmp_path, None, **settings) as client:
        make_namespace(client, "wide", num_layers=16, num_experts=256, top_k=2)
        rows = [one_token(f"w{i}", layers=16, width=2) for i in range(40)]
        body = encode_writes(rows)
        assert 3 * len(body) < 1 << 20  # the body alone fits many times over
        message = error(send(client, body, "wide"), 413, "payload_too_large")
        assert "R3STORE_UPLOAD_MEMORY_BYTES" in message
        assert "send at most" in message
        assert count(client, "wide") == 0
        assert client.app.state.budget.used == 0
        assert send(client, encode_writes(rows[:10]), "wide").status_code == 200
        assert count(client, "wide") == 10
        assert client.app.state.budget.used == 0


def test_an_upload_answered_past_its_deadline_encodes_no_further_and_never_lands(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release, finished = threading.Event(), threading.Event()
    prepared: list[str] = []
    committed: list[object] = []
    prepare, encode, commit = Encoder.prepare, Engine.encode, Engine.commit

    def slow_prepare(self: Encoder, spec: Any, write: TrajectoryWrite, *args: Any) -> Any:
        prepared.append(write.trajectory_id)
        release.wait(30)  # the first row outlives the request's deadline
        return prepare(self, spec, write, *args)

    def watched_encode(self: Engine, *args: Any, **kwargs: Any) -> Any:
        try:
            return encode(self, *args, **kwargs)
        finally:
            finished.set()

    def watched_commit(self: Engine, put: Any) -> Any:
        committed.append(put)
        return commit(self, put)

    monkeypatch.setattr(Encoder, "prepare", slow_prepare)
    monkeypatch.setattr(Engine, "encode", watched_encode)
    monkeypatch.setattr(Engine, "commit", watched_commit)
    with service(tmp_path, None, request_timeout=1.0) as client:
        make_namespace(client)
        answer = upload(client, [make_write(f"s{i}") for i in range(5)])
        error(answer, 503, "store_error")
        release.set()
        assert finished.wait(30)
        assert prepared == ["s0"], "rows were encoded after the answer"
        assert committed == []
        client.app.state.engine.flush()
        assert count(client) == 0


def test_encode_stops_between_rows_once_asked(
    make_engine: MakeEngine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    engine.namespaces.create("ns", SPEC)
    asked: list[int] = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 3

    with pytest.raises(StoreError, match="answered"):
        engine.encode("ns", [make_write(f"e{i}") for i in range(100)], stop=stop)
    assert len(asked) == 4
    assert engine.namespaces.count("ns") == 0


def test_the_deadline_tells_abandoned_work_that_its_request_was_answered() -> None:
    done = threading.Event()
    seen: list[bool] = []

    async def main() -> Deadline:
        deadline = Deadline(0.05)
        release = threading.Event()

        def work() -> None:
            release.wait(30)
            seen.append(deadline.cancelled.is_set())
            done.set()

        assert not deadline.cancelled.is_set()
        with pytest.raises(StoreError):
            await deadline.run(work, what="the work")
        release.set()
        return deadline

    deadline = anyio.run(main)
    assert done.wait(30)
    assert seen == [True]
    assert deadline.cancelled.is_set()


def test_work_that_finishes_leaves_the_deadline_uncancelled() -> None:
    async def main() -> Deadline:
        deadline = Deadline(30)
        assert await deadline.run(lambda: 7) == 7
        with pytest.raises(ValueError, match="invalid literal"):
            await deadline.run(int, "x")
        assert await deadline.run(lambda: 8) == 8
        return deadline

    assert not anyio.run(main).cancelled.is_set()


# ---- item 5: the decoded size of an answer


@pytest.fixture
def reads(tmp_path: Path) -> Iterator[AppClient]:
    """Two trajectories of 40,000 tokens: each 1.25 MiB as masks, 625 KiB as ids, a few
    KiB stored; answers of at most 1 MiB."""
    with service(tmp_path, None, max_read_bytes=1 << 20) as client:
        make_namespace(client)
        body: dict[str, Any] = {"name": "once", "spec": {"num_layers": 4, "num_experts": 64}}
        body["spec"]["top_k"] = 4
        body["settings"] = {"max_times_sampled": 1}
        assert client.post("/v1/namespaces", json=body, headers=auth("admin")).status_code == 201
        for ns in ("ns", "once"):
            writes = [long_write("a", 40_000), long_write("b", 40_000)]
            assert upload(client, writes, ns).status_code == 200
        yield client


def batch_read(client: AppClient, ids: list[str], fmt: str, ns: str = "ns") -> Any:
    return client.post(
        f"/v1/namespaces/{ns}/routes/batch",
        json={"ids": ids, "format": fmt},
        headers=auth("reader"),
    )


def test_reads_over_the_decoded_limit_are_refused_before_decoding(
    reads: AppClient, counted: dict[str, int]
) -> None:
    message = error(batch_read(reads, ["a"], "mask"), 413, "payload_too_large")
    assert "R3STORE_MAX_READ_BYTES" in message
    assert str(1 << 20) in message
    assert str(40_000 * 4 * 8) in message
    assert "alone" in message
    assert "encoded" in message
    message = error(batch_read(reads, ["a", "b"], "ids"), 413, "payload_too_large")
    assert "at most about 1 of the 2 ids" in message
    assert counted["decode"] == 0, "routes were decoded for an answer that was refused"
    one = batch_read(reads, ["a"], "ids")
    assert one.status_code == 200, one.text
    _spec, batch = wire.decode_batch(one.content)
    assert batch.items[0] is not None
    assert batch.items[0].num_tokens == 40_000
    both = batch_read(reads, ["a", "b"], "encoded")  # the stored streams: a few KiB
    assert both.status_code == 200
    assert len(both.content) < 1 << 20
    loads = reads.post(
        "/v1/namespaces/ns/stats/experts/trajectories",
        json={"ids": ["a", "b"]},
        headers=auth("reader"),
    )
    error(loads, 413, "payload_too_large")
    loads = reads.post(
        "/v1/namespaces/ns/stats/experts/trajectories", json={"ids": ["a"]}, headers=auth("reader")
    )
    assert loads.status_code == 200, loads.text


def test_a_sample_over_the_decoded_limit_is_refused_and_counts_nothing(reads: AppClient) -> None:
    def take(fmt: str) -> Any:
        return reads.post(
            "/v1/namespaces/once/routes/sample",
            json={"n": 2, "format": fmt},
            headers=auth("reader"),
        )

    error(take("mask"), 413, "payload_too_large")
    taken = take("encoded")
    assert taken.status_code == 200, taken.text
    _spec, batch = wire.decode_batch(taken.content)
    assert sorted(batch.ids) == ["a", "b"]  # the refused sample took none of them


def test_answer_bytes_follow_the_format(make_engine: MakeEngine, tmp_path: Path) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    engine.namespaces.create("ns", SPEC)
    tokens = np.arange(50, dtype=np.int32)
    engine.put("ns", [make_write("t", tokens=50, token_ids=tokens), make_write("u", tokens=30)])
    found = make_engine.catalog().segments.lookup("ns", ["t", "u"])
    segments = [s for held in found.values() for s in held]
    batch = engine.get_batch("ns", ["t", "u"], decode=False)
    for fmt in ReadFormat:
        answer = pa.ipc.open_stream(encode_batch(batch, SPEC, fmt)).read_all()
        sent = sum(
            len(v)
            for name in ("route_ids", "route_counts", "route_order", "token_ids")
            for v in answer.column(name).to_pylist()
            if v is not None
        )
        assert wire.answer_bytes(SPEC, fmt, segments) == sent, fmt


def test_encoding_an_answer_stops_once_asked(
    make_engine: MakeEngine, tmp_path: Path, counted: dict[str, int]
) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    engine.namespaces.create("ns", SPEC)
    engine.put("ns", [make_write(f"t{i}") for i in range(4)])
    batch = engine.get_batch("ns", [f"t{i}" for i in range(4)], decode=False)
    with pytest.raises(StoreError, match="answered"):
        encode_batch(batch, SPEC, ReadFormat.MASK, stop=lambda: True)
    assert counted["decode"] == 0


# ---- item 6: linear parsing, and bounded columns


def with_columns(extra: int, nested: int = 0) -> bytes:
    table = pa.ipc.open_stream(encode_writes([make_write("wide")])).read_all()
    columns = dict(zip(table.column_names, table.columns, strict=True))
    one = pa.array([1], pa.int8())
    columns.update({f"extra{i}": one for i in range(extra)})
    if nested:
        kind = pa.struct([(f"f{i}", pa.int8()) for i in range(nested)])
        columns["nested"] = pa.array([{f"f{i}": 1 for i in range(nested)}], kind)
    return body_of(pa.table(columns))


def test_uploads_of_too_many_columns_are_refused(tmp_path: Path) -> None:
    known = len(wire.UPLOAD_COLUMNS)
    with service(tmp_path, None) as client:
        make_namespace(client)
        for body in (with_columns(20_000), with_columns(65 - known), with_columns(0, nested=100)):
            message = error(send(client, body), 400, "invalid_input")
            assert "more than 64 fields" in message
        assert count(client) == 0
        assert send(client, with_columns(64 - known)).status_code == 200
        assert count(client) == 1


class Counted(list[TrajectoryWrite]):
    """A list of writes that counts the elements handed out by its iterations."""

    handed = 0

    def __iter__(self) -> Iterator[TrajectoryWrite]:
        self.handed += len(self)
        return super().__iter__()


def test_annotations_and_appends_look_their_trajectory_up_once(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    engine.namespaces.create("ns", SPEC)
    n = 1000
    base = [one_token(f"t{i}") for i in range(n)]
    predicted = [
        TrajectoryWrite(f"t{i}", 2, topk=w.topk, source="predicted") for i, w in enumerate(base)
    ]
    writes = Counted([*base, *predicted])
    engine.put("ns", writes)
    assert writes.handed <= 8 * len(writes), "each write scanned the whole put"
    assert engine.namespaces.count("ns") == n
    batch = engine.get_batch("ns", ["t0"], source="predicted")
    assert batch.items[0] is not None
    assert batch.items[0].source == "predicted"


class Start(int):
    """A start that counts how often it is compared."""

    compared: ClassVar[list[int]] = [0]

    def __eq__(self, other: object) -> bool:
        self.compared[0] += 1
        return int(self) == other

    __hash__ = int.__hash__


def test_settling_appends_costs_the_same_however_many_segments_are_held(
    make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    n = 1000
    known = {("t", ENGINE): [Segment(Start(i), 1, b"%d" % i, None, 0, 0) for i in range(n)]}
    ids = np.arange(4, dtype=np.int8)[None, None, :].repeat(4, axis=1)
    rows = [
        engine.encoder.prepare(SPEC, TrajectoryWrite("t", 1, topk=ids, start=n + i))
        for i in range(n)
    ]
    Start.compared[0] = 0
    fresh, results = settle_rows(rows, known)
    assert len(fresh) == n
    assert all(r.created for r in results.values())
    assert Start.compared[0] <= n, "each segment was compared with every one held"


def test_the_largest_body_leaves_room_for_its_rows_under_the_default_share() -> None:
    from r3store.engine import put_row_bytes
    from r3store.spec import RouteSpec
    from r3store_server.api_routes import charge_rows
    from r3store_server.limits import MemoryBudget
    from r3store_server.settings import UPLOAD_COST, Settings

    settings = Settings()
    assert settings.upload_memory_key_bytes >= (UPLOAD_COST + 1) * settings.max_body_bytes
    budget = MemoryBudget(settings.upload_memory_bytes, per_key=settings.upload_memory_key_bytes)
    spec = RouteSpec(48, 128, 8)
    held = budget.reserve(UPLOAD_COST * settings.max_body_bytes, key="writer")
    rows = settings.max_body_bytes // put_row_bytes(spec)  # as many rows as a body's worth
    charge_rows(rows, spec, budget, held)  # no 413 for the documented largest upload
    assert held.nbytes == UPLOAD_COST * settings.max_body_bytes + rows * put_row_bytes(spec)
