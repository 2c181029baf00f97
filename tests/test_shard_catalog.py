"""Shards readable by plain Parquet readers; the catalog and its rebuild."""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
import zstandard

from helpers import SPEC, MakeEngine, expected_ids, make_write
from r3store.engine import Engine, EngineConfig
from r3store.engine.reader import ReaderConfig
from r3store.engine.rebuild import rebuild_catalog
from r3store.engine.writer import WriterConfig
from r3store.errors import Conflict, NotFound
from r3store.spans import ByteRange
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.keys import SHARD_PREFIX
from r3store.storage.shard import FORMAT_VERSION
from r3store.storage.store import LocalStore, ObjectStore


def small_row_groups() -> EngineConfig:
    return EngineConfig(writer=WriterConfig(row_group_bytes=3_000, commit_interval=0.01))


def fill(engine: Engine, n: int = 24) -> dict[str, object]:
    engine.namespaces.create("ns", SPEC)
    writes = [
        make_write(f"t{i}", group_id=f"g{i // 4}", policy_version=i // 8, prompt_len=5)
        for i in range(n)
    ]
    engine.put("ns", writes)
    return {w.trajectory_id: w for w in writes}


def test_shards_are_plain_parquet(tmp_path: Path, make_engine: MakeEngine) -> None:
    store = LocalStore(tmp_path / "objects")
    writes = fill(make_engine(store, small_row_groups()))
    [shard] = [p for p in (tmp_path / "objects" / "shards" / "ns").iterdir()]
    # pyarrow alone, no r3store code
    pf = pq.ParquetFile(shard)
    meta = pf.metadata.metadata
    assert meta[b"r3store.format_version"] == FORMAT_VERSION.encode()
    assert b'"num_experts": 64' in meta[b"r3store.route_spec"]
    assert pf.metadata.num_row_groups > 1, "rows spread over several row groups"
    table = pf.read()
    assert sorted(table.column("trajectory_id").to_pylist()) == sorted(writes)
    row = table.filter(pc.equal(table.column("trajectory_id"), "t5")).to_pylist()[0]
    assert (row["group_id"], row["policy_version"], row["prompt_len"]) == ("g1", 0, 5)
    # the documented layout decodes with numpy and zstandard alone
    write = writes["t5"]
    raw = zstandard.ZstdDecompressor().decompress(row["route_ids"], max_output_size=10**8)
    gaps = np.frombuffer(raw, np.uint8).reshape(SPEC.num_layers, row["num_tokens"], SPEC.top_k)
    ids = gaps.astype(np.int64)
    if row["route_transform"] == 1:
        ids[..., 1:] += 1
        ids = np.cumsum(ids, axis=-1) % 256
    counts = np.frombuffer(
        zstandard.ZstdDecompressor().decompress(row["route_counts"], max_output_size=10**8),
        np.uint8,
    ).reshape(SPEC.num_layers, row["num_tokens"])
    want = expected_ids(write)
    got = np.where(np.arange(SPEC.top_k) < counts[..., None], ids, -1).transpose(1, 0, 2)
    assert np.array_equal(got, want)


def test_duckdb_reads_shards(tmp_path: Path, make_engine: MakeEngine) -> None:
    duckdb = pytest.importorskip("duckdb")
    store = LocalStore(tmp_path / "objects")
    fill(make_engine(store))
    pattern = str(tmp_path / "objects" / "shards" / "ns" / "*.parquet")
    rows = duckdb.sql(
        f"SELECT policy_version, count(*), sum(num_tokens) FROM read_parquet('{pattern}') "
        "GROUP BY policy_version ORDER BY policy_version"
    ).fetchall()
    assert [r[:2] for r in rows] == [(0, 8), (1, 8), (2, 8)]


def test_reads_fetch_exactly_the_asked_bytes(tmp_path: Path, make_engine: MakeEngine) -> None:
    class Counting(LocalStore):
        ranges: ClassVar[list[tuple[str, int, int]]] = []

        def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
            if byte_range is not None:
                self.ranges.append((key, byte_range.start, byte_range.end))
            return super().get(key, byte_range)

    store = Counting(tmp_path / "objects")
    config = EngineConfig(
        writer=WriterConfig(row_group_bytes=3_000),
        reader=ReaderConfig(cache_bytes=0, coalesce_bytes=20_000, gap_bytes=64),
    )
    engine = make_engine(store, config)
    writes = fill(engine)
    entries = {
        tid: e[0] for tid, e in make_engine.catalog().segments.lookup("ns", list(writes)).items()
    }

    def stream_bytes(ids: list[str]) -> set[tuple[str, int]]:
        """Every byte offset of these trajectories' stored route values."""
        data = {}
        out = set()
        for tid in ids:
            entry = entries[tid]
            if entry.shard_key not in data:
                data[entry.shard_key] = (tmp_path / "objects" / entry.shard_key).read_bytes()
            for span in entry.spans.spans:
                out.update((entry.shard_key, b) for b in range(span.offset, span.end))
        return out

    Counting.ranges.clear()
    engine.get_batch("ns", ["t0"])
    read = [(k, b) for k, start, end in Counting.ranges for b in range(start, end)]
    assert stream_bytes(["t0"]) <= set(read)
    assert len(set(read) - stream_bytes(["t0"])) <= 64 * len(Counting.ranges)

    Counting.ranges.clear()
    some = [f"t{i}" for i in (1, 2, 3, 9, 10, 17, 23)]
    batch = engine.get_batch("ns", some * 2)
    assert not batch.missing
    read = [(k, b) for k, start, end in Counting.ranges for b in range(start, end)]
    assert len(read) == len(set(read)), "no byte read twice"
    wanted = stream_bytes(some)
    assert wanted <= set(read)
    extra = len(set(read) - wanted)
    assert extra <= 64 * len(Counting.ranges), "only the small gaps between streams"
    assert len(Counting.ranges) < sum(len(entries[t].spans.spans) for t in some), (
        "neighbouring streams share a request"
    )


def test_stored_spans_hold_the_route_values(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"), small_row_groups())
    writes = fill(engine)
    for tid, [entry] in make_engine.catalog().segments.lookup("ns", list(writes)).items():
        table = pq.read_table(tmp_path / "objects" / entry.shard_key)
        row = table.filter(pc.equal(table.column("trajectory_id"), tid)).to_pylist()[0]
        data = (tmp_path / "objects" / entry.shard_key).read_bytes()
        spans = entry.spans
        assert data[spans.ids.offset : spans.ids.end] == row["route_ids"]
        assert spans.counts is not None
        assert data[spans.counts.offset : spans.counts.end] == row["route_counts"]
        assert spans.order is None
        assert row["route_order"] is None


def test_catalog_lookups(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = make_engine(LocalStore(tmp_path / "objects"))
    writes = fill(engine)
    catalog = make_engine.catalog()
    assert set(catalog.segments.lookup("ns", ["t1", "t2", "zz"])) == {"t1", "t2"}
    assert [e.trajectory_id for e in catalog.segments.by_group("ns", "g2")] == [
        "t10",
        "t11",
        "t8",
        "t9",
    ]
    assert {e.trajectory_id for e in catalog.segments.by_versions("ns", 1, 2)} == {
        f"t{i}" for i in range(8, 24)
    }
    assert catalog.segments.count("ns") == len(writes)
    [entry] = catalog.segments.lookup("ns", ["t3"])["t3"]
    assert entry.num_tokens == writes["t3"].num_tokens
    assert entry.prompt_len == 5
    with pytest.raises(NotFound):
        catalog.namespaces.get("nope")
    with pytest.raises(Conflict):
        engine.namespaces.create("ns", RouteSpec(4, 64, 2))
    again, created = engine.namespaces.create("ns", SPEC)
    assert (again.spec, created) == (SPEC, False)


def test_rebuild_from_the_store_alone(
    store: ObjectStore, make_engine: MakeEngine, tmp_path: Path
) -> None:
    engine = make_engine(store, small_row_groups())
    writes = fill(engine)
    engine.namespaces.create("empty-run", RouteSpec(2, 8, 2))
    more = [make_write(f"u{i}") for i in range(5)]
    engine.put("ns", more)
    before = make_engine.catalog().segments.lookup(
        "ns", [*writes, *(w.trajectory_id for w in more)]
    )
    engine.close()

    fresh = Catalog(f"sqlite:///{tmp_path / 'rebuilt.db'}")
    seen: list[tuple[int, int]] = []
    report = rebuild_catalog(store, fresh, progress=lambda done, total: seen.append((done, total)))
    assert report.trajectories == len(before)
    assert report.namespaces == 2
    assert not report.conflicts
    assert not report.skipped
    assert seen[-1][0] == seen[-1][1] == report.shards
    after = fresh.segments.lookup("ns", list(before))
    assert after == before
    assert fresh.namespaces.get("empty-run").spec == RouteSpec(2, 8, 2)
    reopened = Engine(store, fresh)
    try:
        batch = reopened.get_batch("ns", ["t7", "u3"])
        assert np.array_equal(batch.items[0].routes.to_topk(), expected_ids(writes["t7"]))
    finally:
        reopened.close()


def test_rebuild_skips_corrupt_objects(tmp_path: Path, make_engine: MakeEngine) -> None:
    store = LocalStore(tmp_path / "objects")
    engine = make_engine(store)
    fill(engine, 4)
    store.put(f"{SHARD_PREFIX}ns/0000000000000-garbage.parquet", b"not parquet at all")
    report = rebuild_catalog(store, Catalog(f"sqlite:///{tmp_path / 'r.db'}"))
    assert report.trajectories == 4
    assert len(report.skipped) == 1
    assert "garbage" in report.skipped[0]
