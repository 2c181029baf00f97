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

import numpy as np
import pytest

from r3store.errors import Conflict, InvalidInput, NotFound
from r3store.logic import stats as stats_lib
from r3store.policy import NamespaceSettings
from r3store.spans import Span
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog, head
from r3store.storage.catalog.ledger import DELETING, INGEST
from r3store.storage.catalog.stats import AgreementRecord, LoadRecord
from r3store.testing.catalog_base import SPEC, entry, shard
from r3store.testing.catalog_consumption import ConsumptionTests

__all__ = ["SPEC", "CatalogTests", "entry", "shard"]


class CatalogTests(ConsumptionTests):
    """The checks every catalog database passes; see the module docstring. Those of
    consumption (leases, checkpoints, resume) are `ConsumptionTests`'."""

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
