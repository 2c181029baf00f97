"""The catalog's repositories against SQLite and PostgreSQL (`r3store.testing.catalog`,
read and written around the catalog with sqlite3 and psycopg), and its schema
migrations: a catalog made before migrations (and before route sources) upgraded on
open, one with today's schema stamped, a newer one refused, `r3store migrate`."""

from __future__ import annotations

import sqlite3
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from r3store.errors import InvalidConfig
from r3store.storage.catalog import Catalog, head, metadata, plan_at
from r3store.testing.catalog import SPEC, CatalogTests, entry, shard
from r3store.testing.postgres import Postgres
from r3store_server import cli


class TestSQLiteCatalog(CatalogTests):
    @pytest.fixture
    def catalog(self, tmp_path: Path) -> Iterator[Catalog]:
        made = Catalog(f"sqlite:///{tmp_path / 'c.db'}")
        yield made
        made.close()

    def _file(self, catalog: Catalog) -> str:
        return catalog.url.removeprefix("sqlite:///")

    def raw_query(
        self, catalog: Catalog, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        with sqlite3.connect(self._file(catalog)) as db:
            return [tuple(r) for r in db.execute(sql, tuple(params))]

    def raw_execute(self, catalog: Catalog, sql: str, params: Sequence[Any] = ()) -> None:
        with sqlite3.connect(self._file(catalog)) as db:
            db.execute(sql, tuple(params))


class TestPostgresCatalog(CatalogTests):
    @pytest.fixture
    def catalog(self, postgres_server: Postgres) -> Iterator[Catalog]:
        made = Catalog(postgres_server.database(f"c_{uuid.uuid4().hex[:12]}"))
        yield made
        made.close()

    def _dsn(self, catalog: Catalog) -> str:
        return catalog.url.replace("postgresql+psycopg://", "postgresql://")

    def raw_query(
        self, catalog: Catalog, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        with psycopg.connect(self._dsn(catalog)) as db:
            rows = db.execute(sql.replace("?", "%s"), tuple(params)).fetchall()  # type: ignore[arg-type]
        return [tuple(bytes(v) if isinstance(v, memoryview) else v for v in r) for r in rows]

    def raw_execute(self, catalog: Catalog, sql: str, params: Sequence[Any] = ()) -> None:
        with psycopg.connect(self._dsn(catalog)) as db:
            db.execute(sql.replace("?", "%s"), tuple(params))  # type: ignore[arg-type]


# ---- migrations

# the tables as r3store made them before route sources (git history: r3store/catalog.py)
BEFORE_SOURCES = [
    """CREATE TABLE namespaces (name VARCHAR(128) NOT NULL, spec TEXT NOT NULL,
    settings TEXT NOT NULL, created_at FLOAT NOT NULL, policy_version BIGINT NOT NULL,
    PRIMARY KEY (name))""",
    """CREATE TABLE shards (key VARCHAR(512) NOT NULL, namespace VARCHAR(128) NOT NULL,
    size BIGINT NOT NULL, num_rows INTEGER NOT NULL, route_bytes BIGINT NOT NULL,
    created_at FLOAT NOT NULL, retired_at FLOAT, PRIMARY KEY (key))""",
    "CREATE INDEX ix_shards_namespace ON shards (namespace)",
    """CREATE TABLE trajectories (namespace VARCHAR(128) NOT NULL,
    trajectory_id VARCHAR(256) NOT NULL, start BIGINT NOT NULL, group_id VARCHAR(256),
    policy_version BIGINT NOT NULL, num_tokens INTEGER NOT NULL, prompt_len INTEGER NOT NULL,
    digest BLOB NOT NULL, route_bytes BIGINT NOT NULL, shard_key VARCHAR(512) NOT NULL,
    row_group INTEGER NOT NULL, row_index INTEGER NOT NULL, transform SMALLINT NOT NULL,
    ids_offset BIGINT NOT NULL, ids_length BIGINT NOT NULL, counts_offset BIGINT,
    counts_length BIGINT, order_offset BIGINT, order_length BIGINT, tokens_offset BIGINT,
    tokens_length BIGINT, created_at FLOAT NOT NULL, times_sampled INTEGER NOT NULL,
    PRIMARY KEY (namespace, trajectory_id, start))""",
    "CREATE INDEX ix_trajectories_group ON trajectories (namespace, group_id)",
    "CREATE INDEX ix_trajectories_version ON trajectories (namespace, policy_version)",
    "CREATE INDEX ix_trajectories_shard_key ON trajectories (shard_key)",
    """CREATE TABLE api_keys (name VARCHAR(64) NOT NULL, role VARCHAR(16) NOT NULL,
    namespaces TEXT NOT NULL, digest BLOB NOT NULL, created_at FLOAT NOT NULL,
    revoked_at FLOAT, PRIMARY KEY (name))""",
    "INSERT INTO namespaces VALUES ('ns', '{spec}', '{{}}', 1.0, 2)",
    "INSERT INTO shards VALUES ('s1', 'ns', 1000, 1, 100, 1.0, NULL)",
    """INSERT INTO trajectories VALUES ('ns', 't', 0, 'g', 2, 6, 2, x'{digest}', 100, 's1',
    0, 0, 1, 10, 20, 30, 4, NULL, NULL, 40, 8, 1.0, 3)""",
]


def _old_catalog(url: str, dialect: str) -> None:
    raw = sa.create_engine(url)
    with raw.begin() as conn:
        for statement in BEFORE_SOURCES:
            sql = statement.format(spec=SPEC.to_json(), digest="00" * 16)
            if dialect == "postgresql":
                sql = sql.replace("BLOB", "BYTEA").replace("FLOAT", "DOUBLE PRECISION")
                sql = sql.replace(f"x'{'00' * 16}'", f"'\\x{'00' * 16}'::bytea")
            conn.execute(sa.text(sql))
    raw.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'c.db'}"
    server: Postgres = request.getfixturevalue("postgres_server")
    return server.database(f"m_{uuid.uuid4().hex[:12]}")


def _version(url: str) -> list[str]:
    raw = sa.create_engine(url)
    try:
        with raw.connect() as conn:
            return list(conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars())
    finally:
        raw.dispose()


def _columns(url: str) -> dict[str, list[str]]:
    raw = sa.create_engine(url)
    try:
        inspector = sa.inspect(raw)
        return {
            t: [c["name"] for c in inspector.get_columns(t)]
            for t in metadata.tables
            if inspector.has_table(t)
        }
    finally:
        raw.dispose()


def test_a_new_catalog_has_todays_schema_and_its_version(url: str) -> None:
    Catalog(url).close()
    assert _version(url) == [head()]
    assert _columns(url) == {
        name: [c.name for c in t.columns] for name, t in metadata.tables.items()
    }


def test_a_catalog_made_before_sources_is_upgraded_on_open(url: str) -> None:
    dialect = "sqlite" if url.startswith("sqlite") else "postgresql"
    _old_catalog(url, dialect)
    assert plan_at(url).action == "upgrade"
    catalog = Catalog(url)
    try:
        assert _version(url) == [head()]
        assert _columns(url) == {
            name: [c.name for c in t.columns] for name, t in metadata.tables.items()
        }
        [got] = catalog.segments.lookup("ns", ["t"])["t"]
        assert (got.source, got.times_sampled, got.policy_version) == ("engine", 3, 2)
        assert got.spans.ids.offset == 10
        assert got.spans.tokens is not None
        assert got.spans.dictionary is None
        assert got.writer is None
        assert catalog.shards.get("s1").rest_level is None
        assert catalog.namespaces.get("ns").spec == SPEC
        catalog.ledger.plan_upload("s2", "ns", "ingest", 1.0)
        catalog.shards.commit(shard("s2"), [entry("t", "s2", source="trainer")])
        assert [e.source for e in catalog.segments.lookup("ns", ["t"])["t"]] == [
            "engine",
            "trainer",
        ]
    finally:
        catalog.close()
    assert plan_at(url).action == "nothing"


def test_a_catalog_of_todays_schema_without_a_version_is_stamped(url: str) -> None:
    catalog = Catalog(url)
    catalog.namespaces.create("ns", SPEC)
    catalog.close()
    raw = sa.create_engine(url)
    with raw.begin() as conn:
        conn.execute(sa.text("DROP TABLE alembic_version"))
    raw.dispose()
    assert plan_at(url).action == "stamp"
    catalog = Catalog(url)
    assert catalog.namespaces.get("ns").spec == SPEC
    catalog.close()
    assert _version(url) == [head()]


def test_a_newer_catalog_is_refused(url: str) -> None:
    Catalog(url).close()
    raw = sa.create_engine(url)
    with raw.begin() as conn:
        conn.execute(sa.text("UPDATE alembic_version SET version_num = '9999'"))
    raw.dispose()
    with pytest.raises(InvalidConfig, match=rf"revision 9999.*newest is {head()}"):
        Catalog(url)
    with pytest.raises(InvalidConfig, match="9999"):
        plan_at(url)
    assert _version(url) == ["9999"]  # left untouched


def test_opening_without_upgrading_refuses_an_old_catalog(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'c.db'}"
    _old_catalog(url, "sqlite")
    with pytest.raises(InvalidConfig, match="r3store migrate"):
        Catalog(url, upgrade=False)
    assert "source" not in _columns(url)["trajectories"]


def test_two_catalogs_opening_one_new_database_migrate_it_once(tmp_path: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    url = f"sqlite:///{tmp_path / 'c.db'}"
    _old_catalog(url, "sqlite")
    with ThreadPoolExecutor(4) as pool:
        opened = list(pool.map(lambda _: Catalog(url), range(4)))
    for catalog in opened:
        assert [e.source for e in catalog.segments.lookup("ns", ["t"])["t"]] == ["engine"]
        catalog.close()
    assert _version(url) == [head()]


def test_r3store_migrate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path / "data"))
    for name in ("R3STORE_CATALOG_URL", "R3STORE_STORE"):
        monkeypatch.delenv(name, raising=False)
    assert cli.main(["migrate"]) == 2  # no catalog there: none is made
    assert "no catalog at" in capsys.readouterr().err
    (tmp_path / "data").mkdir()
    url = f"sqlite:///{tmp_path / 'data' / 'catalog.db'}"
    _old_catalog(url, "sqlite")
    assert cli.main(["migrate", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "none recorded" in out
    assert head() in out
    assert "upgrade" in out
    assert "source" not in _columns(url)["trajectories"]  # a dry run changes nothing
    assert cli.main(["migrate", "--json"]) == 0
    done = capsys.readouterr().out
    assert f'"target": "{head()}"' in done
    assert '"dry_run": false' in done
    assert _version(url) == [head()]
    assert "source" in _columns(url)["trajectories"]
    assert cli.main(["migrate", "--dry-run"]) == 0
    assert "nothing to do" in capsys.readouterr().out
