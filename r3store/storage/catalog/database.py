"""The catalog's database: the SQLAlchemy engine over SQLite or PostgreSQL (any
SQLAlchemy URL works with the same code), its connections and transactions, the one
place where database errors become the project's (`translated`), and the mapping
between rows and the catalog's values (`segment_row`, `segment_of`, `namespace_of`).

SQLite runs in WAL mode with `synchronous=FULL`: a committed write survives a crash.
The tables are in `r3store.storage.catalog.tables`; the repositories over them
(`namespaces`, `segments`, `shards`, `keys`, `stats`, `ledger`, `leases`, `checkpoints`)
are each a `Repository` over a `Database`, running each call in a connection or a
transaction of its own.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from r3store.catalog_types import NamespaceInfo, TrajectoryEntry
from r3store.errors import Conflict, StoreError
from r3store.policy import NamespaceSettings
from r3store.spans import COLUMNS, RouteSpans
from r3store.spec import RouteSpec
from r3store.storage.catalog.tables import namespaces, uploads

BATCH = 500  # ids per IN (...) query


@contextmanager
def translated() -> Iterator[None]:
    """The one place where database errors become the project's: a violated key is a
    `Conflict`, anything else (an outage, a timeout) a retryable `StoreError`."""
    try:
        yield
    except IntegrityError as exc:
        raise Conflict(f"already in the catalog: {first_line(exc.orig)}") from exc
    except SQLAlchemyError as exc:
        raise StoreError(f"the catalog is unavailable: {first_line(exc)}") from exc


def first_line(exc: object) -> str:
    return str(exc).strip().split("\n")[0][:300]


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


def _sqlite_exclusive(dbapi_connection: Any, record: Any) -> None:
    """A migration's connection: pysqlite's own transaction handling off, so that the
    DDL runs inside the `BEGIN IMMEDIATE` that `_sqlite_begin` emits."""
    _sqlite_pragmas(dbapi_connection, record)
    dbapi_connection.isolation_level = None


def _sqlite_begin(conn: Connection) -> None:
    conn.exec_driver_sql("BEGIN IMMEDIATE")


class Database:
    """The connection pool of one catalog database. Thread-safe: each call takes its own
    connection from the pool."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        """`timeout` bounds each wait on the database: a connection, a lock, a
        statement (SQLite's busy timeout; PostgreSQL's connect and statement timeouts).
        Past it a call raises `StoreError`."""
        self.url = url
        self.timeout = timeout
        self.engine: Engine = self._make_engine()
        if self.dialect == "sqlite":
            sa.event.listen(self.engine, "connect", _sqlite_pragmas)

    def _make_engine(self) -> Engine:
        kwargs: dict[str, Any] = {"pool_timeout": self.timeout}
        if self.url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": self.timeout}
        elif self.url.startswith("postgresql"):
            kwargs["connect_args"] = {
                "connect_timeout": max(1, round(self.timeout)),
                "options": f"-c statement_timeout={round(self.timeout * 1000)}",
            }
        return sa.create_engine(self.url, **kwargs)

    @property
    def dialect(self) -> str:
        """`sqlite`, `postgresql`, or another SQLAlchemy dialect's name."""
        return self.engine.dialect.name

    def close(self) -> None:
        self.engine.dispose()

    @contextmanager
    def connect(self) -> Iterator[Connection]:
        with translated(), self.engine.connect() as conn:
            yield conn

    @contextmanager
    def begin(self) -> Iterator[Connection]:
        """A transaction: committed when the block ends, rolled back on any error."""
        with translated(), self.engine.begin() as conn:
            yield conn

    @contextmanager
    def exclusive(self) -> Iterator[Connection]:
        """A transaction that holds the database against every other migration (and,
        on SQLite, every other writer) until it ends, for changing the schema: SQLite's
        `BEGIN IMMEDIATE` on a connection of its own, PostgreSQL's transaction-scoped
        advisory lock (its DDL is transactional)."""
        if self.dialect == "sqlite":
            engine = self._make_engine()
            sa.event.listen(engine, "connect", _sqlite_exclusive)
            sa.event.listen(engine, "begin", _sqlite_begin)
            try:
                with translated(), engine.begin() as conn:
                    yield conn
            finally:
                engine.dispose()
            return
        with self.begin() as conn:
            if self.dialect == "postgresql":
                conn.execute(sa.text("SELECT pg_advisory_xact_lock(7255372301)"))
            yield conn

    def ping(self) -> None:
        with self.connect() as conn:
            conn.execute(sa.text("SELECT 1"))


class Repository:
    """One of the catalog's repositories (`Catalog.namespaces`, `Catalog.segments`, ...):
    each of its calls runs in a connection or a transaction of its own on `db`."""

    def __init__(self, db: Database) -> None:
        self._db = db


# rows and values


def segment_row(entry: TrajectoryEntry) -> dict[str, Any]:
    """The `trajectories` row of a segment (its spans as `RouteSpans.to_columns`)."""
    row = {k: v for k, v in entry.__dict__.items() if k != "spans"}
    row.update(entry.spans.to_columns())
    return row


def segment_of(row: Any) -> TrajectoryEntry:
    """The segment a `trajectories` row holds."""
    data = dict(row._mapping)
    try:
        spans = RouteSpans.from_columns(data)
    except ValueError as exc:
        raise StoreError(f"catalog row of {data['trajectory_id']!r} has {exc}") from None
    for name in COLUMNS:
        del data[name]
    return TrajectoryEntry(**data, spans=spans)


def lock(conn: Connection, name: str) -> bool:
    """Hold the namespace's row for the transaction (an UPDATE that changes nothing:
    PostgreSQL's row lock, SQLite's write lock), as consumption's changes do; False when
    there is no such namespace. The first statement of its transaction, on SQLite."""
    done = conn.execute(
        namespaces.update().where(namespaces.c.name == name).values(consumed=namespaces.c.consumed)
    )
    return bool(done.rowcount)


def lock_name(conn: Connection, name: str) -> None:
    """Hold `name` for the transaction, so that transactions that read then write what
    `name` owns take turns: PostgreSQL's transaction-scoped advisory lock on it (other
    names go on), SQLite's write lock (every writer waits), taken by a write that
    changes nothing. The first statement of its transaction, on SQLite."""
    if conn.dialect.name == "postgresql":
        conn.execute(sa.text("SELECT pg_advisory_xact_lock(72553, hashtext(:n))"), {"n": name})
    else:
        conn.execute(uploads.update().where(uploads.c.key == "").values(key=uploads.c.key))


def namespace_of(row: Any) -> NamespaceInfo:
    """The namespace a `namespaces` row holds."""
    return NamespaceInfo(
        row.name,
        RouteSpec.from_json(row.spec),
        row.created_at,
        row.policy_version,
        NamespaceSettings.model_validate_json(row.settings),
    )


def namespace_row(info: NamespaceInfo) -> dict[str, Any]:
    """The `namespaces` row of a namespace."""
    return {
        "name": info.name,
        "spec": info.spec.to_json(),
        "settings": info.settings.model_dump_json(),
        "created_at": info.created_at,
        "policy_version": info.policy_version,
    }
