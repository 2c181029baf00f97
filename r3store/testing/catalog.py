"""A conformance suite for the catalog's repositories, checked from the outside.

Subclass `CatalogTests` with a `catalog` fixture (a fresh, empty catalog) and the
backdoors that read and write its database directly (sqlite3, psycopg), bypassing the
catalog under test, and pytest runs every check on that database:

    class TestSQLiteCatalog(CatalogTests):
        @pytest.fixture
        def catalog(self, tmp_path): ...
        def raw_query(self, catalog, sql, params=()): ...    # rows as tuples
        def raw_execute(self, catalog, sql, params=()): ...  # committed

SQL is written with `?` placeholders. A repository that only agreed with itself
(writing a column the wrong way and reading it back the same wrong way, say) fails these.
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np
import pytest

from r3store.catalog_types import ShardInfo, TrajectoryEntry
from r3store.errors import (
    Conflict,
    Fenced,
    InvalidInput,
    LeaseClosed,
    LeaseCommitted,
    LeaseExpired,
    NotFound,
)
from r3store.logic import stats as stats_lib
from r3store.logic.spans import RouteSpans, Span
from r3store.policy import ENGINE, NamespaceSettings, Retention, Source
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog, head
from r3store.storage.catalog.leases import Terms
from r3store.storage.catalog.ledger import DELETING, INGEST
from r3store.storage.catalog.stats import AgreementRecord, LoadRecord

SPEC = RouteSpec(2, 8, 2)


def entry(
    tid: str,
    shard: str,
    *,
    start: int = 0,
    group: str | None = None,
    version: int = 0,
    source: Source = ENGINE,
    created: float = 1.0,
    dictionary: bytes | None = None,
) -> TrajectoryEntry:
    spans = RouteSpans(Span(10, 20), Span(30, 4), None, 1, Span(40, 8), dictionary)
    return TrajectoryEntry(
        "ns",
        tid,
        start,
        group,
        version,
        6,
        2,
        bytes(16),
        100,
        shard,
        0,
        0,
        created,
        spans,
        source=source,
    )


def shard(key: str, rows: int = 1, created: float = 1.0) -> ShardInfo:
    return ShardInfo(key, "ns", 1000, rows, 100 * rows, created)


class CatalogTests(ABC):
    """The checks every catalog database passes; see the module docstring."""

    @abstractmethod
    def raw_query(
        self, catalog: Catalog, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        """The rows `sql` selects, read around the catalog."""

    @abstractmethod
    def raw_execute(self, catalog: Catalog, sql: str, params: Sequence[Any] = ()) -> None:
        """Run `sql` around the catalog, committed."""

    def commit(self, catalog: Catalog, info: ShardInfo, entries: Sequence[TrajectoryEntry]) -> None:
        catalog.ledger.plan_upload(info.key, info.namespace, INGEST, 0.0)
        catalog.shards.commit(info, entries)

    # the schema

    def test_the_schema_version_is_recorded(self, catalog: Catalog) -> None:
        assert self.raw_query(catalog, "SELECT version_num FROM alembic_version") == [(head(),)]

    # namespaces

    def test_a_namespace_lands_as_its_row(self, catalog: Catalog) -> None:
        settings = NamespaceSettings(max_policy_lag=3)
        _, created = catalog.namespaces.create("ns", SPEC, settings, created_at=5.0)
        assert created
        [(spec, stored, at, version)] = self.raw_query(
            catalog, "SELECT spec, settings, created_at, policy_version FROM namespaces"
        )
        assert RouteSpec.from_json(spec) == SPEC
        assert json.loads(stored)["max_policy_lag"] == 3
        assert (at, version) == (5.0, 0)
        again, created = catalog.namespaces.create("ns", RouteSpec(4, 8, 2))
        assert not created
        assert again.spec == SPEC  # what exists, for the caller to compare

    def test_namespaces_read_what_the_database_holds(self, catalog: Catalog) -> None:
        for name in ("b", "a"):
            self.raw_execute(
                catalog,
                "INSERT INTO namespaces (name, spec, settings, created_at, policy_version) "
                "VALUES (?, ?, ?, ?, ?)",
                (name, SPEC.to_json(), NamespaceSettings().model_dump_json(), 2.0, 7),
            )
        assert [n.name for n in catalog.namespaces.all()] == ["a", "b"]
        got = catalog.namespaces.get("a")
        assert (got.spec, got.policy_version, got.created_at) == (SPEC, 7, 2.0)
        with pytest.raises(NotFound):
            catalog.namespaces.get("c")

    def test_policy_versions_move_forward_only(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        catalog.namespaces.set_policy_version("ns", 4)
        with pytest.raises(InvalidInput):
            catalog.namespaces.set_policy_version("ns", 3)
        with pytest.raises(InvalidInput):
            catalog.namespaces.set_policy_version("ns", 9, max_step=2)
        catalog.namespaces.set_policy_version("ns", 1, force=True)
        assert self.raw_query(catalog, "SELECT policy_version FROM namespaces") == [(1,)]
        catalog.namespaces.update_settings("ns", NamespaceSettings(max_policy_lag=1))
        [(stored,)] = self.raw_query(catalog, "SELECT settings FROM namespaces")
        assert json.loads(stored)["max_policy_lag"] == 1
        with pytest.raises(NotFound):
            catalog.namespaces.update_settings("nope", NamespaceSettings())

    def test_deleting_a_namespace_forgets_its_rows(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1"), [entry("t", "s1")])
        catalog.ledger.plan_upload("s2", "ns", INGEST, 1.0)
        keys = catalog.namespaces.delete("ns")
        assert set(keys) == {"s1", "s2"}
        for table in ("namespaces", "shards", "trajectories"):
            assert self.raw_query(catalog, f"SELECT COUNT(*) FROM {table}") == [(0,)], table
        assert sorted(self.raw_query(catalog, "SELECT key, kind FROM uploads")) == [
            ("s1", DELETING),
            ("s2", DELETING),
        ]
        with pytest.raises(NotFound):
            catalog.namespaces.delete("ns")

    # segments

    def test_a_commit_lands_as_rows(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1", 2), [entry("t", "s1"), entry("t", "s1", start=6)])
        rows = self.raw_query(
            catalog,
            "SELECT trajectory_id, source, start, shard_key, ids_offset, ids_length, "
            "counts_offset, order_offset, tokens_length, prefix_tokens FROM trajectories "
            "ORDER BY start",
        )
        assert rows == [
            ("t", "engine", 0, "s1", 10, 20, 30, None, 8, 0),
            ("t", "engine", 6, "s1", 10, 20, 30, None, 8, 0),
        ]
        assert self.raw_query(catalog, "SELECT key, num_rows FROM shards") == [("s1", 2)]
        assert self.raw_query(catalog, "SELECT COUNT(*) FROM uploads") == [(0,)]

    def test_lookup_reads_what_the_database_holds(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1"), [entry("t", "s1")])
        self.raw_execute(catalog, "UPDATE trajectories SET ids_offset = 99, policy_version = 3")
        [got] = catalog.segments.lookup("ns", ["t", "missing"])["t"]
        assert got.spans.ids == Span(99, 20)
        assert got.spans.order is None
        assert got.policy_version == 3
        assert catalog.segments.lookup("ns", ["missing"]) == {}

    def test_queries_by_group_version_and_counts(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        entries = [
            entry("a", "s1", group="g", version=1, created=3.0),
            entry("b", "s1", group="g", version=2, created=1.0),
            entry("b", "s1", group="g", version=2, start=6, created=1.0),
            entry("c", "s1", version=2, created=2.0),
            entry("a", "s1", group="g", version=1, source="trainer", created=3.0),
        ]
        self.commit(catalog, shard("s1", len(entries)), entries)
        group = catalog.segments.by_group("ns", "g")
        assert [(e.trajectory_id, e.start) for e in group] == [("a", 0), ("b", 0), ("b", 6)]
        assert [e.trajectory_id for e in catalog.segments.by_versions("ns", 2, 2)] == [
            "b",
            "b",
            "c",
        ]
        assert catalog.segments.count("ns") == 3
        assert catalog.segments.count_by_version("ns") == {1: 1, 2: 2}
        assert catalog.segments.newest_version("ns") == 2
        assert catalog.segments.newest_version("ns", 2) == 1
        assert catalog.segments.newest_version("ns", 3) is None
        assert catalog.stats.annotated_ids("ns") == ["a"]

    def test_sampling_counts_in_the_database(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        entries = [entry("a", "s1", version=1), entry("b", "s1", version=0)]
        self.commit(catalog, shard("s1", 2), entries)
        seen: list[list[str]] = []

        def every(rows: list[tuple[str, str | None, float]]) -> list[str]:
            seen.append(sorted(r[0] for r in rows))
            return [r[0] for r in rows]

        sample = Terms(min_version=None, max_times=1, seconds=60.0, commit=True)
        done = catalog.leases.take("ns", every, replace(sample, min_version=1), now=10.0)
        assert (seen, done.trajectory_ids, done.seq) == ([["a"]], ("a",), 1)
        catalog.leases.take("ns", every, sample, now=10.0)
        assert seen[-1] == ["b"]  # a was sampled its one time
        self.raw_execute(
            catalog, "UPDATE trajectories SET times_sampled = 5 WHERE trajectory_id = 'b'"
        )
        assert sorted(
            self.raw_query(catalog, "SELECT trajectory_id, times_sampled FROM trajectories")
        ) == [
            ("a", 1),
            ("b", 5),
        ]
        assert self.raw_query(catalog, "SELECT consumed FROM namespaces") == [(2,)]
        assert catalog.segments.sampling_totals("ns") == (6, 2)
        catalog.leases.take("ns", every, sample, now=10.0)
        assert seen[-1] == []
        assert catalog.segments.retention_victims("ns", 1, None, None) == ["b"]
        assert catalog.segments.retention_victims("ns", None, None, 5) == ["b"]
        assert catalog.segments.retention_victims("ns", None, 2.0, None) == ["a", "b"]

    def test_leases_hold_count_once_and_resume(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        ids = [f"t{i}" for i in range(4)]
        entries = [entry(t, "s1", created=float(i)) for i, t in enumerate(ids)]
        self.commit(catalog, shard("s1", 4), entries)

        def oldest(k: int) -> Any:
            return lambda rows: [r[0] for r in sorted(rows, key=lambda r: r[2])[:k]]

        def times() -> dict[str, int]:
            rows = self.raw_query(catalog, "SELECT trajectory_id, times_sampled FROM trajectories")
            return dict(rows)

        window = Terms(min_version=None, max_times=1, seconds=5.0)
        first = catalog.leases.take("ns", oldest(2), window, now=100.0)
        assert (first.trajectory_ids, first.epoch) == (("t0", "t1"), 0)
        second = catalog.leases.take("ns", oldest(2), window, now=101.0)
        assert second.trajectory_ids == ("t2", "t3")  # t0, t1 are held
        assert times() == dict.fromkeys(ids, 0)  # nothing counted before a commit
        assert self.raw_query(
            catalog, "SELECT state, expires_at FROM leases WHERE lease_id = ?", [first.lease_id]
        ) == [("open", 105.0)]
        committed = catalog.leases.commit("ns", first.lease_id, now=102.0)
        assert (committed.seq, times()["t0"], times()["t1"]) == (1, 1, 1)
        with pytest.raises(LeaseCommitted):
            catalog.leases.commit("ns", first.lease_id, now=102.5)
        with pytest.raises(LeaseExpired):  # second expired at 106: t2, t3 went back
            catalog.leases.commit("ns", second.lease_id, now=106.0)
        assert times()["t2"] == 0
        assert self.raw_query(  # the refused commit marked it expired, once and for all
            catalog, "SELECT state, closed_at FROM leases WHERE lease_id = ?", [second.lease_id]
        ) == [("expired", 106.0)]
        assert catalog.leases.open("ns", 105.9) == []
        point = catalog.checkpoints.checkpoint("ns", 1, now=107.0)
        assert (point.step, point.consumed, point.epoch) == (1, 1, 0)
        assert catalog.checkpoints.checkpoint("ns", 1, now=107.5) == point  # a repeat
        third = catalog.leases.take("ns", oldest(2), window, now=108.0)
        assert third.trajectory_ids == ("t2", "t3")
        catalog.leases.commit("ns", third.lease_id, now=109.0)
        assert catalog.leases.protected("ns", now=109.0) == {"t2", "t3"}
        with pytest.raises(Conflict):  # step 1 again, with other consumption
            catalog.checkpoints.checkpoint("ns", 1, now=109.5)
        catalog.checkpoints.checkpoint("ns", 2, now=110.0)
        zombie = catalog.leases.take("ns", oldest(1), replace(window, seconds=50.0), now=110.0)
        assert zombie.trajectory_ids == ()  # every trajectory was sampled its one time
        done = catalog.checkpoints.resume("ns", 1, now=111.0)
        assert (done.epoch, done.leases_undone, done.samplings_undone) == (1, 1, 2)
        assert (done.leases_fenced, done.checkpoints_dropped) == (1, [2])
        assert times() == {"t0": 1, "t1": 1, "t2": 0, "t3": 0}
        assert self.raw_query(catalog, "SELECT epoch, consumed FROM namespaces") == [(1, 1)]
        assert catalog.checkpoints.checkpoint("ns", 1, now=111.5) == point  # nothing since
        with pytest.raises(Fenced):
            catalog.leases.commit("ns", zombie.lease_id, now=112.0)
        with pytest.raises(Fenced):
            catalog.leases.commit("ns", third.lease_id, now=112.0)  # undone by the resume
        with pytest.raises(Fenced):
            catalog.leases.take("ns", oldest(1), replace(window, epoch=0), now=112.0)
        again = catalog.leases.take("ns", oldest(2), replace(window, epoch=1), now=112.0)
        assert again.trajectory_ids == ("t2", "t3")  # what the checkpoint implies
        released = catalog.leases.release("ns", again.lease_id, now=113.0)
        assert released.state == "released"
        with pytest.raises(LeaseClosed):
            catalog.leases.renew("ns", again.lease_id, 5.0, now=113.5)
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [1]
        assert catalog.leases.prune("ns", before=1000.0) >= 3
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [1]
        for step in (2, 3):
            catalog.checkpoints.checkpoint("ns", step, now=113.6)
        catalog.namespaces.update_settings(
            "ns", NamespaceSettings(retention=Retention(keep_checkpoints=1))
        )
        catalog.leases.prune("ns", before=0.0)  # keep_checkpoints lowered to 1: trimmed
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [3]
        catalog.checkpoints.delete_checkpoint("ns", 3)
        with pytest.raises(NotFound):
            catalog.checkpoints.delete_checkpoint("ns", 3)
        with pytest.raises(NotFound):
            catalog.checkpoints.resume("ns", 1, now=114.0)

    def test_retention_keeps_what_leases_and_checkpoints_hand_out(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        ids = ["a", "b", "c", "d"]
        entries = [entry(t, "s1", created=float(i)) for i, t in enumerate(ids)]
        self.commit(catalog, shard("s1", 4), entries)

        def named(*wanted: str) -> Any:
            return lambda rows: [r[0] for r in rows if r[0] in wanted]

        terms = Terms(min_version=None, max_times=None, seconds=50.0)
        catalog.checkpoints.checkpoint("ns", 0, now=1.0)
        done = catalog.leases.take("ns", named("a"), terms, now=2.0)
        catalog.leases.commit("ns", done.lease_id, now=3.0)
        # retention chose its victims before this lease was taken: the lease keeps b
        catalog.leases.take("ns", named("b"), terms, now=4.0)
        assert catalog.leases.drop("ns", ids, ["s1"], now=5.0) == (2, 2)  # c, d dropped
        assert sorted(catalog.segments.lookup("ns", ids)) == ["a", "b"]
        catalog.checkpoints.resume("ns", 0, now=6.0)  # a undone, b's lease fenced
        # a is handed out again by the resumed run: still kept while checkpoint 0 is
        assert catalog.leases.protected("ns", now=7.0) == {"a"}
        assert catalog.leases.drop("ns", ["a", "b"], ["s1"], now=7.0) == (1, 1)
        assert catalog.leases.prune("ns", before=10**6) == 1  # b's fenced lease, not a's
        catalog.checkpoints.delete_checkpoint("ns", 0)
        assert catalog.leases.protected("ns", now=8.0) == set()

    def test_deleting_segments(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1", 2), [entry("a", "s1"), entry("b", "s1")])
        self.commit(catalog, shard("s2"), [entry("b", "s2", start=6)])
        assert catalog.segments.delete("ns", ["a", "b"], shard_keys=["s1"]) == 1  # b stays whole
        assert sorted(self.raw_query(catalog, "SELECT trajectory_id, start FROM trajectories")) == [
            ("b", 0),
            ("b", 6),
        ]
        assert catalog.segments.delete("ns", ["b"]) == 2
        assert self.raw_query(catalog, "SELECT COUNT(*) FROM trajectories") == [(0,)]

    # shards

    def test_a_commit_needs_its_planned_upload(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        with pytest.raises(Conflict):
            catalog.shards.commit(shard("s1"), [entry("t", "s1")])
        assert self.raw_query(catalog, "SELECT COUNT(*) FROM trajectories") == [(0,)]
        catalog.ledger.plan_upload("s1", "ns", INGEST, 1.0)
        assert catalog.ledger.claim_orphan("s1", cutoff=2.0)
        with pytest.raises(Conflict):
            catalog.shards.commit(shard("s1"), [entry("t", "s1")])
        assert self.raw_query(catalog, "SELECT kind FROM uploads") == [(DELETING,)]

    def test_shard_usage_retire_and_forget(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1", 2), [entry("a", "s1"), entry("b", "s1")])
        self.commit(catalog, shard("s2", 0, created=2.0), [])
        usage = {u.key: (u.live_rows, u.live_bytes) for u in catalog.shards.usage("ns")}
        assert usage == {"s1": (2, 200), "s2": (0, 0)}
        assert catalog.shards.get("s1").num_rows == 2
        assert not catalog.shards.retire_empty("s1", 5.0)
        assert catalog.shards.retire_empty("s2", 5.0)
        assert sorted(self.raw_query(catalog, "SELECT key, retired_at FROM shards")) == [
            ("s1", None),
            ("s2", 5.0),
        ]
        assert catalog.shards.retired_before(6.0) == ["s2"]
        assert catalog.shards.retired_before(5.0) == []
        assert [u.key for u in catalog.shards.usage()] == ["s1"]
        catalog.shards.forget("s2")
        assert catalog.shards.all_keys() == {"s1"}
        assert self.raw_query(catalog, "SELECT key FROM shards") == [("s1",)]
        with pytest.raises(NotFound):
            catalog.shards.get("s2")

    def test_replacing_shards(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        self.commit(catalog, shard("s1", 2), [entry("a", "s1"), entry("b", "s1")])
        moved = [entry("a", "s9")]
        catalog.ledger.plan_upload("s9", "ns", INGEST, 1.0)
        with pytest.raises(Conflict):  # b is not in the new shard: the rows differ
            catalog.shards.replace(["s1"], shard("s9"), moved, 7.0)
        assert self.raw_query(catalog, "SELECT retired_at FROM shards") == [(None,)]
        moved.append(entry("b", "s9"))
        assert catalog.shards.replace(["s1"], shard("s9", 2), moved, 7.0) == 2
        assert sorted(self.raw_query(catalog, "SELECT key, retired_at FROM shards")) == [
            ("s1", 7.0),
            ("s9", None),
        ]
        assert set(self.raw_query(catalog, "SELECT shard_key FROM trajectories")) == {("s9",)}
        assert [e.trajectory_id for e in catalog.segments.entries_in("s9")] == ["a", "b"]

    def test_replace_all_fills_the_catalog_again(self, catalog: Catalog) -> None:
        info, _ = catalog.namespaces.create("ns", SPEC)
        catalog.keys.add("k", "admin", ["*"], bytes(32))
        self.commit(catalog, shard("s1"), [entry("a", "s1")])
        loads: list[LoadRecord] = []
        contents = iter([(shard("s2"), [entry("b", "s2", dictionary=b"d" * 16)], loads)])
        catalog.shards.replace_all([info], contents, [("ns", b"e" * 16)])
        assert self.raw_query(catalog, "SELECT trajectory_id, shard_key FROM trajectories") == [
            ("b", "s2")
        ]
        assert self.raw_query(catalog, "SELECT key FROM shards") == [("s2",)]
        assert self.raw_query(catalog, "SELECT name FROM api_keys") == [("k",)]  # not in the store
        assert sorted(self.raw_query(catalog, "SELECT digest FROM dictionaries")) == [
            (b"d" * 16,),
            (b"e" * 16,),
        ]
        assert catalog.segments.dictionary_for("ns", 0) == (b"d" * 16, 0)

    # keys

    def test_api_keys(self, catalog: Catalog) -> None:
        catalog.keys.add("k", "trainer", ["a", "b"], b"x" * 32)
        [(role, spaces, digest, revoked)] = self.raw_query(
            catalog, "SELECT role, namespaces, digest, revoked_at FROM api_keys"
        )
        assert (role, json.loads(spaces), bytes(digest), revoked) == (
            "trainer",
            ["a", "b"],
            b"x" * 32,
            None,
        )
        with pytest.raises(Conflict):
            catalog.keys.add("k", "admin", ["*"], b"y" * 32)
        catalog.keys.revoke("k")
        assert self.raw_query(
            catalog, "SELECT COUNT(*) FROM api_keys WHERE revoked_at IS NOT NULL"
        ) == [(1,)]
        assert catalog.keys.all(active_only=True) == []
        with pytest.raises(NotFound):
            catalog.keys.revoke("k")
        catalog.keys.add("k", "admin", ["*"], b"y" * 32)  # a revoked name is taken again
        [key] = catalog.keys.all()
        assert (key.role, key.namespaces, key.digest) == ("admin", ["*"], b"y" * 32)

    # statistics

    def test_expert_load_and_agreement(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        counts = np.arange(16, dtype=np.int64).reshape(2, 8)
        loads = [LoadRecord("ns", "s1", 1, "engine", 6, counts)]
        catalog.ledger.plan_upload("s1", "ns", INGEST, 0.0)
        catalog.shards.commit(shard("s1"), [entry("a", "s1", version=1)], loads)
        assert self.raw_query(
            catalog, "SELECT shard_key, policy_version, tokens FROM expert_load"
        ) == [("s1", 1, 6)]
        [(tokens, held)] = catalog.stats.expert_loads("ns", "engine", (2, 8)).values()
        assert tokens == 6
        assert np.array_equal(held, counts)
        overlap = stats_lib.Overlap(np.array([3, 4]), np.array([4, 4]))
        record = AgreementRecord("ns", "a", 0, "engine", "trainer", 1, 6, overlap)
        catalog.stats.add_agreements([record, record])
        assert self.raw_query(catalog, "SELECT COUNT(*) FROM route_agreement") == [(1,)]
        [(segments, tokens, got)] = catalog.stats.agreements(
            "ns", ("trainer", "engine"), 2
        ).values()
        assert (segments, tokens) == (1, 6)
        assert np.array_equal(got.matches, [3, 4])

    # the ledger

    def test_identity_and_generation(self, catalog: Catalog) -> None:
        assert catalog.ledger.identity() is None
        assert catalog.ledger.is_empty()
        assert catalog.ledger.bind_identity("first") == "first"
        assert catalog.ledger.bind_identity("second") == "first"  # the first one wins
        assert catalog.ledger.bind_identity("second", replace=True) == "second"
        assert self.raw_query(
            catalog, "SELECT value FROM catalog_meta WHERE key = 'catalog_id'"
        ) == [("second",)]
        assert catalog.ledger.generation() == 0
        assert catalog.ledger.advance_generation(0)
        assert not catalog.ledger.advance_generation(0)
        self.raw_execute(catalog, "UPDATE catalog_meta SET value = '5' WHERE key = 'generation'")
        assert catalog.ledger.generation() == 5
        catalog.namespaces.create("ns", SPEC)
        assert not catalog.ledger.is_empty()

    def test_planned_uploads(self, catalog: Catalog) -> None:
        catalog.ledger.plan_upload("u1", "ns", INGEST, 1.0)
        catalog.ledger.plan_upload("u2", "other", INGEST, 3.0)
        assert [p.key for p in catalog.ledger.pending_uploads()] == ["u1", "u2"]
        assert [p.key for p in catalog.ledger.pending_uploads("other")] == ["u2"]
        assert not catalog.ledger.claim_orphan("u2", cutoff=2.0)  # too young
        assert catalog.ledger.claim_orphan("u1", cutoff=2.0)
        assert sorted(self.raw_query(catalog, "SELECT key, kind FROM uploads")) == [
            ("u1", DELETING),
            ("u2", INGEST),
        ]
        catalog.ledger.forget_upload("u1")
        assert self.raw_query(catalog, "SELECT key FROM uploads") == [("u2",)]

    def test_dictionaries(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        digest = b"d" * 16
        assert not catalog.ledger.hold_dictionary("ns", digest, 1.0)  # not recorded
        assert catalog.ledger.record_dictionary("ns", digest, 2, 1.0)
        assert self.raw_query(catalog, "SELECT policy_version, used_at FROM dictionaries") == [
            (2, 1.0)
        ]
        assert catalog.ledger.dictionary_keys() == {f"dictionaries/ns/{digest.hex()}.zdict"}
        assert catalog.ledger.unused_dictionaries(cutoff=2.0) == [("ns", digest)]
        self.commit(catalog, shard("s1"), [entry("a", "s1", dictionary=digest)])
        assert catalog.ledger.unused_dictionaries(cutoff=2.0) == []  # a row names it
        assert not catalog.ledger.start_dropping_dictionary("ns", digest, cutoff=2.0)
        catalog.segments.delete("ns", ["a"])
        assert catalog.ledger.start_dropping_dictionary("ns", digest, cutoff=2.0)
        assert self.raw_query(catalog, "SELECT used_at FROM dictionaries") == [(-1.0,)]
        assert not catalog.ledger.hold_dictionary("ns", digest, 3.0)  # being deleted
        assert not catalog.ledger.record_dictionary("ns", digest, 2, 3.0)
        catalog.ledger.forget_dictionary("ns", digest)
        assert self.raw_query(catalog, "SELECT COUNT(*) FROM dictionaries") == [(0,)]
