"""Compression at rest: cold shards merged, rows compressed again with a namespace
dictionary at a high level, prompt routes stored once per group; reads, rebuilds,
direct reads and a third-party decoder all see the same routes."""

from __future__ import annotations

import dataclasses
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import zstandard

from helpers import MakeEngine
from http_helpers import KEYS, ServerProcess
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.errors import InvalidRoutes, PlanGone
from r3store.logic import codec, rest
from r3store.logic.codec import Transform
from r3store.logic.routes import Routes, from_topk
from r3store.logic.writes import canonical_routes, encode_write
from r3store.policy import NamespaceSettings, Retention
from r3store.protocol.wire import ReadFormat, encode_batch
from r3store.records import Batch, TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.dictionary import read_dictionary
from r3store.storage.keys import DICTIONARY_PREFIX, SHARD_PREFIX, parse_dictionary_key
from r3store.storage.store import ObjectStore
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import skewed_topk
from r3store_client import Client

SPEC = RouteSpec(8, 64, 4, ordered=True, allow_fewer=True)
TOKENS, PROMPT, GROUPS, SIZE = 1200, 480, 8, 6
ODD = "g1-s2"  # its prompt routes differ from its group's in one slot


def _group_writes(version: int = 0) -> dict[str, tuple[TrajectoryWrite, np.ndarray]]:
    """GRPO groups: samples share their prompt's routes (one sample differs in one
    slot); some token-layers chose fewer experts. As a trained router's, a token's
    routes through every layer follow from the token (one of 2048 here)."""
    rng = np.random.default_rng(version)
    router = skewed_topk(rng, 2048, 8, 64, 4).astype(np.int16)  # [vocabulary, L, K]

    def routed(tokens: int) -> np.ndarray:
        return router[rng.integers(0, len(router), tokens)]

    out = {}
    for g in range(GROUPS):
        prompt = routed(PROMPT)
        prompt[rng.random(prompt.shape[:2]) < 0.05, 3] = -1
        for s in range(SIZE):
            ids = np.concatenate([prompt, routed(TOKENS - PROMPT)])
            tid = f"g{g}-s{s}" if version == 0 else f"v{version}-g{g}-s{s}"
            if tid == ODD:
                ids[7, 2, 3] = next(e for e in range(64) if e not in ids[7, 2])
            write = TrajectoryWrite(
                tid,
                TOKENS,
                topk=ids,
                group_id=f"{version}/g{g}",
                prompt_len=PROMPT,
                policy_version=version,
            )
            out[tid] = (write, ids)
    return out


def _check(engine: Engine, writes: dict[str, tuple[TrajectoryWrite, np.ndarray]]) -> None:
    batch = engine.get_batch("ns", list(writes))
    assert batch.missing == []
    for tid, item in zip(batch.ids, batch.items, strict=True):
        assert item is not None
        assert item.routes is not None
        assert np.array_equal(item.routes.to_topk(), writes[tid][1]), tid
    stored = engine.get_batch("ns", list(writes), decode=False)
    for tid, item in zip(stored.ids, stored.items, strict=True):
        assert item is not None
        assert item.routes is None
        parts = []
        for segment in item.segments:  # streams handed out decode alone
            assert segment.encoded is not None
            assert codec.self_contained(segment.encoded)
            parts.append(codec.decode(segment.encoded, SPEC, segment.num_tokens))
        assert np.array_equal(Routes.concat(parts).to_topk(), writes[tid][1]), tid
    _answers_decode_once(engine, list(writes), stored)


def _answers_decode_once(engine: Engine, ids: list[str], portable: Batch) -> None:
    """The server's answers, made from rows as stored (`as_stored`), are those made from
    streams made portable first, byte for byte, in every format; and each segment
    crosses the codec once: one decode per segment for `ids`, `mask` and a layer read."""
    as_stored = engine.get_batch("ns", ids, decode=False, as_stored=True)
    segments = sum(len(item.segments) for item in as_stored.found)
    real, calls, depth = codec.decode, [0], [0]

    def counted(*args: Any, **kwargs: Any) -> Routes:
        calls[0] += depth[0] == 0  # a segment's decode, not the prefix's inside it
        depth[0] += 1
        try:
            return real(*args, **kwargs)
        finally:
            depth[0] -= 1

    for fmt, layers in [
        (ReadFormat.ENCODED, None),
        (ReadFormat.IDS, None),
        (ReadFormat.MASK, None),
        (ReadFormat.ENCODED, [1, 5]),
    ]:
        want = encode_batch(portable, SPEC, fmt, layers=layers)
        codec.decode = counted  # type: ignore[assignment]
        calls[0] = 0
        try:
            got = encode_batch(as_stored, SPEC, fmt, layers=layers)
        finally:
            codec.decode = real  # type: ignore[assignment]
        assert got == want, fmt
        at_rest = sum(
            not codec.self_contained(s.encoded)
            for item in as_stored.found
            for s in item.segments
            if s.encoded is not None
        )
        expected = at_rest if (fmt, layers) == (ReadFormat.ENCODED, None) else segments
        assert calls[0] == expected, (fmt, layers, calls[0], expected)


def test_cold_shards_are_merged_and_compressed_again(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC, NamespaceSettings(retention=Retention(keep_versions=1)))
    writes = _group_writes()
    for write, _ids in writes.values():  # one put each: as many shards
        engine.put("ns", [write])
    before = engine.namespaces.usage("ns")
    assert before.shards == len(writes)

    assert engine.upkeep.maintenance().run().shards_merged == 0  # not cold yet
    report = engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run()
    assert (report.shards_merged, report.shards_at_rest) == (len(writes), 1)
    assert report.dictionaries_trained == 1
    after = engine.namespaces.usage("ns")
    assert after.shards == 1
    assert after.live_route_bytes + report.rest_bytes_saved == before.live_route_bytes
    assert after.live_route_bytes < 0.8 * before.live_route_bytes
    _check(engine, writes)

    found = make_engine.catalog().segments.lookup("ns", list(writes))
    shared = {tid: e[0].spans.prefix_tokens for tid, e in found.items()}
    assert shared[ODD] == 0  # stored whole: its prompt routes differ
    assert {n for tid, n in shared.items() if tid != ODD} == {PROMPT}
    assert len({e[0].spans.dictionary for e in found.values()}) == 1

    # a lone shard at rest is left alone; a rebuild finds every row again
    assert engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run().shards_merged == 0
    engine.flush()
    engine.upkeep.rebuild()
    _check(engine, writes)
    # the retired shards not yet deleted hold the same rows: the copies at rest are kept
    usage = make_engine.catalog().shards.usage("ns")
    assert [u.rest_level for u in usage if u.live_rows] == [rest.REST_LEVEL]
    again = make_engine.catalog().segments.lookup("ns", list(writes))  # and when they were put
    assert {t: e[0].created_at for t, e in again.items()} == {
        t: e[0].created_at for t, e in found.items()
    }
    report = engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run()
    assert (report.shards_merged, report.shards_retired) == (0, len(writes))

    # retention drops the version; its dictionary goes with its last row
    newer = _group_writes(version=1)
    engine.put("ns", [w for w, _ids in newer.values()])
    engine.namespaces.set_policy_version("ns", 1)
    report = engine.upkeep.maintenance(
        MaintenanceOptions(cold_seconds=0, grace_seconds=0, orphan_seconds=0)
    ).run()
    assert report.dictionaries_trained == 1  # the new version's own
    engine.upkeep.maintenance(
        MaintenanceOptions(cold_seconds=0, grace_seconds=0, orphan_seconds=0)
    ).run()
    assert len(list(store.list(DICTIONARY_PREFIX))) == 1
    _check(engine, newer)


def test_a_shard_at_rest_decodes_with_pyarrow_zstandard_and_its_dictionary(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    """docs/format.md, "Compression at rest", followed with third-party tools only."""
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    writes = _group_writes()
    engine.put("ns", [w for w, _ids in writes.values()])
    engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0, grace_seconds=0)).run()
    (shard,) = [o.key for o in store.list(SHARD_PREFIX)]
    table = pq.read_table(io.BytesIO(store.get(shard)))
    assert table.schema.metadata[b"r3store.rest_level"] == str(rest.REST_LEVEL).encode()
    rows = table.to_pylist()
    prefixes = {r["digest"]: r for r in rows if r["kind"] == "prefix"}
    assert len(prefixes) == GROUPS
    assert {r["route_transform"] for r in rows} == {2}  # what routes like these compress best
    dictionaries = {
        o.key.rsplit("/", 1)[1]: zstandard.ZstdCompressionDict(store.get(o.key))
        for o in store.list(DICTIONARY_PREFIX)
    }

    def sets(row: dict[str, object], tokens: int) -> np.ndarray:
        """The row's sorted ids `[L, T, K]` (transform 0, 1 or 2)."""
        name = f"{bytes(row['route_dictionary']).hex()}.zdict"  # type: ignore[arg-type]
        plain = zstandard.ZstdDecompressor(dict_data=dictionaries[name])
        raw = plain.decompress(row["route_ids"], max_output_size=8 * tokens * 4)
        ids = np.frombuffer(raw, np.uint8).reshape(8, tokens, 4).astype(np.int64)
        if row["route_transform"] == 2:  # token-major
            ids = np.frombuffer(raw, np.uint8).reshape(tokens, 8, 4).transpose(1, 0, 2)
            ids = ids.astype(np.int64)
        if row["route_transform"] == 1:
            ids[..., 1:] += 1
            ids = np.cumsum(ids, axis=-1) % 256
        return ids

    for row in rows:
        if row["kind"] != "segment":
            continue
        _write, ids = writes[row["trajectory_id"]]
        expected = np.sort(np.where(ids < 0, 999, ids), axis=-1).transpose(1, 0, 2)
        head = row["prefix_tokens"]
        own = sets(row, row["num_tokens"] - head)
        if head:
            own = np.concatenate([sets(prefixes[row["prefix_digest"]], head), own], axis=1)
        chosen = expected < 999
        assert np.array_equal(np.where(chosen, own, 999), expected), row["trajectory_id"]


def test_a_group_shares_the_prompt_routes_most_samples_carry() -> None:
    """Not necessarily the first sample's: when it is the one that differs, the others
    still share theirs."""
    writes = _group_writes()
    samples = [writes[f"g1-s{s}"][1] for s in range(SIZE)]
    samples[0] = writes[ODD][1]  # the group's first sample differs from most, as ODD does
    spec = RouteSpec(8, 64, 4, ordered=True, allow_fewer=True)
    cold = []
    for ids in samples:
        routes = from_topk(ids, spec, TOKENS)
        cold.append(rest.ColdRow(routes, codec.encode(routes, spec), "g1", "engine", 0, PROMPT))
    settled = rest.settle(spec, cold, None)
    assert ODD == "g1-s2"
    assert [e.prefix_tokens for e in settled] == [0, PROMPT, 0, PROMPT, PROMPT, PROMPT]
    for row, encoded in zip(cold, settled, strict=True):
        assert codec.decode(encoded, spec, TOKENS).equals(row.routes)


def test_an_older_catalog_gains_the_columns(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    Catalog(url).close()
    raw = sa.create_engine(url)
    with raw.begin() as conn:
        for column in ("dictionary", "prefix_tokens", "prefix_digest", "prefix_ids_offset"):
            conn.execute(sa.text(f"ALTER TABLE trajectories DROP COLUMN {column}"))
        conn.execute(sa.text("ALTER TABLE shards DROP COLUMN rest_level"))
        conn.execute(sa.text("DROP TABLE alembic_version"))  # made before migrations, too
    catalog = Catalog(url)
    columns = {c["name"] for c in sa.inspect(raw).get_columns("trajectories")}
    assert {"dictionary", "prefix_tokens", "prefix_digest", "prefix_ids_offset"} <= columns
    assert "rest_level" in {c["name"] for c in sa.inspect(raw).get_columns("shards")}
    catalog.close()
    raw.dispose()


@pytest.fixture
def server(tmp_path: Path, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    process = ServerProcess(
        tmp_path,
        seaweed,
        env={"R3STORE_MAINTENANCE_INTERVAL": "1", "R3STORE_MAINTENANCE_COLD_AGE": "0"},
    )
    yield process
    process.stop()


@pytest.mark.s3
def test_direct_reads_of_rows_at_rest(server: ServerProcess) -> None:
    """Through a real server on SeaweedFS: the plan names the dictionary and the shared
    prefixes; the client fetches them from the store and reads the same routes."""
    writes = _group_writes()
    with Client(server.url, api_key=KEYS["admin"]) as client:
        client.create_namespace("ns", SPEC)
        client.put("ns", [w for w, _ids in writes.values()])
        deadline = time.monotonic() + 60
        while not client.plan("ns", [ODD]).dictionaries:
            assert time.monotonic() < deadline, "maintenance never compressed the shard"
            time.sleep(0.5)
        plan = client.plan("ns", list(writes))
        assert sum(s.spans.prefix is not None for s in plan.segments) == len(writes) - 1
        _spec, direct = client.fetch_direct("ns", list(writes))
        _spec, proxied = client.fetch("ns", list(writes), decode=False)
        for tid, item in zip(direct.ids, direct.items, strict=True):
            assert item is not None  # decoded where the bytes were fetched
            assert item.routes is not None
            assert np.array_equal(item.routes.to_topk(), writes[tid][1]), tid
        for tid, item in zip(proxied.ids, proxied.items, strict=True):
            assert item is not None  # streams again that decode alone
            (segment,) = item.segments
            assert segment.encoded is not None
            routes = codec.decode(segment.encoded, SPEC, segment.num_tokens)
            assert np.array_equal(routes.to_topk(), writes[tid][1]), tid


def test_writes_encoded_with_the_namespace_dictionary_are_checked_kept_and_rested(
    store: ObjectStore, make_engine: MakeEngine
) -> None:
    """What a direct write's worker sends once compression at rest made a dictionary:
    token-major ids compressed with it. The engine checks them with that dictionary,
    refuses one the namespace does not have (or streams it does not decode), serves
    them exactly, and a later pass at rest writes them again like any ingest row."""
    engine = make_engine(store)
    engine.namespaces.create("ns", SPEC)
    for write, _ids in _group_writes().values():
        engine.put("ns", [write])
    assert engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run().dictionaries_trained
    [key] = [o.key for o in store.list(DICTIONARY_PREFIX)]
    parsed = parse_dictionary_key(key)
    assert parsed is not None
    dictionary = read_dictionary(store, *parsed)

    later = _group_writes(version=1)
    encoded = [encode_write(w, SPEC, dictionary) for w, _ids in later.values()]
    for w in encoded:
        assert w.encoded is not None
        assert (w.encoded.transform, w.encoded.dictionary) == (
            Transform.TOKEN_MAJOR,
            dictionary.digest,
        )
    plain = [encode_write(w, SPEC) for w, _ids in later.values()]
    assert sum(len(w.encoded.ids) for w in encoded if w.encoded) < sum(  # smaller with it
        len(w.encoded.ids) for w in plain if w.encoded
    )
    first = encoded[0]
    assert first.encoded is not None
    unknown = dataclasses.replace(first.encoded, dictionary=bytes(16))
    with pytest.raises(PlanGone, match="does not have"):
        engine.put("ns", [dataclasses.replace(first, encoded=unknown)])
    other = rest.train(rest.samples(SPEC, [_cold_row(w) for w, _ids in later.values()]))
    assert other is not None
    lying = dataclasses.replace(  # compressed with another dictionary, naming this one
        first.encoded,
        ids=encode_write(
            dataclasses.replace(first, topk=later[first.trajectory_id][1], encoded=None),
            SPEC,
            other,
        ).encoded.ids,  # type: ignore[union-attr]
    )
    with pytest.raises(InvalidRoutes):
        engine.put("ns", [dataclasses.replace(first, encoded=lying)])
    assert engine.get_batch("ns", [first.trajectory_id]).missing == [first.trajectory_id]

    for w in encoded:
        engine.put("ns", [w])
    _check(engine, later)
    found = make_engine.catalog().segments.lookup("ns", list(later))
    assert {e[0].spans.dictionary for e in found.values()} == {dictionary.digest}
    before = engine.namespaces.usage("ns").live_route_bytes
    report = engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run()
    assert report.shards_merged >= len(later)  # written again at rest, as ingest rows are
    assert engine.namespaces.usage("ns").live_route_bytes < before
    _check(engine, later)


def _cold_row(write: TrajectoryWrite) -> rest.ColdRow:
    routes = canonical_routes(write, SPEC)
    return rest.ColdRow(routes, codec.encode(routes, SPEC), None, "engine", 0, 0)
