"""The catalog: namespaces, shards, and where each trajectory segment lies, on SQLAlchemy Core.

SQLite by default (WAL, synchronous FULL: a committed write survives a crash); any
SQLAlchemy URL works with the same code. The object store is the source of truth:
`r3store.engine.rebuild` can make the catalog again from the shards alone (policy versions,
settings and sampling counts live only here).

A trajectory is one or more segments (multi-turn appends), each a row keyed by its
route source and start token; the `engine` rows are the trajectory (segment 0 starts at 0
and carries its sampling count), rows of other sources annotate them. Statistics tables:
`r3store.storage.catalog.stats`. What the catalog owns in the store (its identity, the uploads
it planned, the dictionaries it holds): `r3store.storage.catalog.ledger`.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine
from sqlalchemy.exc import IntegrityError, SQLAlchemyError

from r3store.catalog_types import (
    ApiKeyRecord,
    NamespaceInfo,
    ShardInfo,
    ShardUsage,
    TrajectoryEntry,
)
from r3store.errors import Conflict, InvalidInput, NotFound, StoreError
from r3store.logic.spans import RouteSpans, Span
from r3store.policy import ENGINE, NamespaceSettings
from r3store.spec import RouteSpec
from r3store.storage.catalog import ledger as catalog_ledger
from r3store.storage.catalog import stats as catalog_stats
from r3store.storage.catalog.ledger import PlannedUpload
from r3store.storage.catalog.stats import AgreementRecord, LoadRecord
from r3store.storage.keys import dictionary_key

metadata = sa.MetaData()

namespaces = sa.Table(
    "namespaces",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
)

shards = sa.Table(
    "shards",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("namespace", sa.String(128), nullable=False, index=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("num_rows", sa.Integer, nullable=False),
    sa.Column("route_bytes", sa.BigInteger, nullable=False),  # of all its rows, as written
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("retired_at", sa.Float),  # no rows point here since; object goes after a grace
    sa.Column("rest_level", sa.SmallInteger),  # zstd level of a shard written at rest
)

trajectories = sa.Table(
    "trajectories",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("trajectory_id", sa.String(256), primary_key=True),
    sa.Column("source", sa.String(16), primary_key=True, server_default=ENGINE),
    sa.Column("start", sa.BigInteger, primary_key=True),
    sa.Column("group_id", sa.String(256)),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("prompt_len", sa.Integer, nullable=False),
    sa.Column("digest", sa.LargeBinary(16), nullable=False),
    sa.Column("route_bytes", sa.BigInteger, nullable=False),
    sa.Column("shard_key", sa.String(512), nullable=False, index=True),
    sa.Column("row_group", sa.Integer, nullable=False),
    sa.Column("row_index", sa.Integer, nullable=False),
    sa.Column("transform", sa.SmallInteger, nullable=False),
    sa.Column("ids_offset", sa.BigInteger, nullable=False),
    sa.Column("ids_length", sa.BigInteger, nullable=False),
    sa.Column("counts_offset", sa.BigInteger),
    sa.Column("counts_length", sa.BigInteger),
    sa.Column("order_offset", sa.BigInteger),
    sa.Column("order_length", sa.BigInteger),
    sa.Column("tokens_offset", sa.BigInteger),
    sa.Column("tokens_length", sa.BigInteger),
    # compression at rest: the ids streams' zstd dictionary, and the shared prefix
    # (a row of the same shard) this segment continues
    sa.Column("dictionary", sa.LargeBinary(16)),
    sa.Column("prefix_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("prefix_digest", sa.LargeBinary(16)),
    sa.Column("prefix_transform", sa.SmallInteger),
    sa.Column("prefix_ids_offset", sa.BigInteger),
    sa.Column("prefix_ids_length", sa.BigInteger),
    sa.Column("prefix_counts_offset", sa.BigInteger),
    sa.Column("prefix_counts_length", sa.BigInteger),
    sa.Column("prefix_order_offset", sa.BigInteger),
    sa.Column("prefix_order_length", sa.BigInteger),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("times_sampled", sa.Integer, nullable=False, default=0),
    sa.Column("writer", sa.String(64)),  # the key that uploaded it (None: unknown)
    sa.Index("ix_trajectories_group", "namespace", "group_id"),
    sa.Index("ix_trajectories_version", "namespace", "policy_version"),
)

api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("namespaces", sa.Text, nullable=False),  # JSON list; ["*"]: all
    sa.Column("digest", sa.LargeBinary(32), nullable=False),  # SHA-256 of the key
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)

_BATCH = 500  # ids per IN (...) query


_SPAN_COLUMNS = ("ids", "counts", "order", "tokens")
_PREFIX_COLUMNS = ("ids", "counts", "order")


def _put_spans(row: dict[str, Any], spans: RouteSpans | None, at: str) -> None:
    names = _SPAN_COLUMNS if at == "" else _PREFIX_COLUMNS
    for name in names:
        span: Span | None = None if spans is None else getattr(spans, name)
        row[f"{at}{name}_offset"] = None if span is None else span.offset
        row[f"{at}{name}_length"] = None if span is None else span.length


def _to_row(entry: TrajectoryEntry) -> dict[str, Any]:
    row = {k: v for k, v in entry.__dict__.items() if k != "spans"}
    spans = entry.spans
    row["transform"] = spans.transform
    _put_spans(row, spans, "")
    row["dictionary"] = spans.dictionary
    row["prefix_tokens"] = spans.prefix_tokens
    row["prefix_transform"] = None if spans.prefix is None else spans.prefix.transform
    row["prefix_digest"] = None if spans.prefix is None else spans.prefix_digest
    _put_spans(row, spans.prefix, "prefix_")
    return row


def _take_spans(data: dict[str, Any], names: tuple[str, ...], at: str) -> dict[str, Span | None]:
    spans = {}
    for name in names:
        offset, length = data.pop(f"{at}{name}_offset"), data.pop(f"{at}{name}_length")
        spans[name] = None if offset is None else Span(offset, length)
    if spans["ids"] is None and (at == "" or data["prefix_tokens"]):
        raise StoreError(f"catalog row of {data['trajectory_id']!r} has no {at}ids span")
    return spans


def _from_row(row: Any) -> TrajectoryEntry:
    data = dict(row._mapping)
    spans = _take_spans(data, _SPAN_COLUMNS, "")
    shared = _take_spans(data, _PREFIX_COLUMNS, "prefix_")
    dictionary, tokens = data.pop("dictionary"), data.pop("prefix_tokens")
    prefix_transform, prefix_digest = data.pop("prefix_transform"), data.pop("prefix_digest")
    prefix = None
    if tokens:
        prefix = RouteSpans(
            shared["ids"],  # type: ignore[arg-type]
            shared["counts"],
            shared["order"],
            prefix_transform,
            dictionary=dictionary,
        )
    routes = RouteSpans(
        spans["ids"],  # type: ignore[arg-type]
        spans["counts"],
        spans["order"],
        data.pop("transform"),
        spans["tokens"],
        dictionary,
        prefix,
        tokens,
        prefix_digest or b"",
    )
    return TrajectoryEntry(**data, spans=routes)


def _namespace(row: Any) -> NamespaceInfo:
    return NamespaceInfo(
        row.name,
        RouteSpec.from_json(row.spec),
        row.created_at,
        row.policy_version,
        NamespaceSettings.model_validate_json(row.settings),
    )


def _sqlite_pragmas(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA synchronous=FULL")
    cursor.close()


@contextmanager
def _translated() -> Iterator[None]:
    """The one place where database errors become the project's: a violated key is a
    `Conflict`, anything else (an outage, a timeout) a retryable `StoreError`."""
    try:
        yield
    except IntegrityError as exc:
        raise Conflict(f"already in the catalog: {_first_line(exc.orig)}") from exc
    except SQLAlchemyError as exc:
        raise StoreError(f"the catalog is unavailable: {_first_line(exc)}") from exc


def _first_line(exc: object) -> str:
    return str(exc).strip().split("\n")[0][:300]


class Catalog:
    """Catalog queries. Thread-safe: each call takes its own connection from the pool."""

    def __init__(self, url: str, timeout: float = 10.0) -> None:
        """`timeout` bounds each wait on the database: a connection, a lock, a
        statement (SQLite's busy timeout; PostgreSQL's connect and statement timeouts).
        Past it a call raises `StoreError`."""
        self.url = url
        kwargs: dict[str, Any] = {"pool_timeout": timeout}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": timeout}
        elif url.startswith("postgresql"):
            kwargs["connect_args"] = {
                "connect_timeout": max(1, round(timeout)),
                "options": f"-c statement_timeout={round(timeout * 1000)}",
            }
        self._engine: Engine = sa.create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            sa.event.listen(self._engine, "connect", _sqlite_pragmas)
        try:
            self._create_tables()
        except BaseException:  # no pool left behind by a catalog that could not open
            self._engine.dispose()
            raise

    def _create_tables(self) -> None:
        with _translated():
            _add_sources(self._engine)
            _add_columns(self._engine)
            ledger_is_new = not sa.inspect(self._engine).has_table("dictionaries")
            metadata.create_all(self._engine)
            catalog_stats.metadata.create_all(self._engine)
            catalog_ledger.metadata.create_all(self._engine)
            if ledger_is_new:  # a catalog made before the ledger: the dictionaries it uses
                with self._engine.begin() as conn:
                    catalog_ledger.record_in_use(conn, trajectories, time.time())

    def close(self) -> None:
        self._engine.dispose()

    @contextmanager
    def _connect(self) -> Iterator[Connection]:
        with _translated(), self._engine.connect() as conn:
            yield conn

    @contextmanager
    def _begin(self) -> Iterator[Connection]:
        """A transaction: committed when the block ends, rolled back on any error."""
        with _translated(), self._engine.begin() as conn:
            yield conn

    def ping(self) -> None:
        with self._connect() as conn:
            conn.execute(sa.text("SELECT 1"))

    # namespaces

    def create_namespace(
        self,
        name: str,
        spec: RouteSpec,
        settings: NamespaceSettings | None = None,
        created_at: float | None = None,
    ) -> tuple[NamespaceInfo, bool]:
        """Create a namespace; returns it and True, or what exists under the name and
        False (the caller compares)."""
        try:
            with self._begin() as conn:
                conn.execute(
                    namespaces.insert().values(
                        name=name,
                        spec=spec.to_json(),
                        settings=(settings or NamespaceSettings()).model_dump_json(),
                        created_at=time.time() if created_at is None else created_at,
                        policy_version=0,
                    )
                )
        except Conflict:
            return self.namespace(name), False
        return self.namespace(name), True

    def namespace(self, name: str) -> NamespaceInfo:
        with self._connect() as conn:
            row = conn.execute(sa.select(namespaces).where(namespaces.c.name == name)).first()
        if row is None:
            raise NotFound(f"no namespace {name!r}")
        return _namespace(row)

    def list_namespaces(self) -> list[NamespaceInfo]:
        with self._connect() as conn:
            rows = conn.execute(sa.select(namespaces).order_by(namespaces.c.name)).all()
        return [_namespace(r) for r in rows]

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespaceInfo:
        with self._begin() as conn:
            done = conn.execute(
                namespaces.update()
                .where(namespaces.c.name == name)
                .values(settings=settings.model_dump_json())
            )
        if done.rowcount == 0:
            raise NotFound(f"no namespace {name!r}")
        return self.namespace(name)

    def set_policy_version(
        self, name: str, version: int, max_step: int | None = None, force: bool = False
    ) -> NamespaceInfo:
        """Move the namespace's current policy version forward (never back), at most
        `max_step` at once; `force`: to `version`, whatever the current one."""
        with self._begin() as conn:
            row = conn.execute(
                sa.select(namespaces.c.policy_version).where(namespaces.c.name == name)
            ).first()
            if row is None:
                raise NotFound(f"no namespace {name!r}")
            if version < row.policy_version and not force:
                raise InvalidInput(
                    f"policy version {version} is older than the current {row.policy_version} "
                    "(an admin key may set it back with force)"
                )
            if max_step is not None and not force and version - row.policy_version > max_step:
                raise InvalidInput(
                    f"policy version {version} is more than {max_step} ahead of the current "
                    f"{row.policy_version}: move it in steps of at most {max_step}, or an admin "
                    "key sets it with force"
                )
            conn.execute(
                namespaces.update().where(namespaces.c.name == name).values(policy_version=version)
            )
        return self.namespace(name)

    def delete_namespace(self, name: str) -> list[str]:
        """Forget a namespace and its trajectories; returns the keys of its objects this
        catalog made (shards, uploads not committed, dictionaries), to delete. They stay
        on the ledger as deletions under way (`forget_upload` each once deleted), so
        that collection finishes what a failure leaves."""
        with self._begin() as conn:
            keys = list(
                conn.execute(sa.select(shards.c.key).where(shards.c.namespace == name)).scalars()
            )
            keys += [p.key for p in catalog_ledger.pending(conn, name)]
            found = catalog_ledger.keys_of(conn, name)
            keys += [dictionary_key(ns, digest) for ns, digest in found]
            conn.execute(trajectories.delete().where(trajectories.c.namespace == name))
            conn.execute(shards.delete().where(shards.c.namespace == name))
            catalog_stats.delete_namespace(conn, name)
            catalog_ledger.delete_namespace(conn, name)
            catalog_ledger.mark_deleting(conn, keys, name)
            done = conn.execute(namespaces.delete().where(namespaces.c.name == name))
            if done.rowcount == 0:
                raise NotFound(f"no namespace {name!r}")
        return keys

    # trajectories

    def _select(self, namespace: str) -> sa.Select[Any]:
        """The trajectories' own rows (engine routes)."""
        t = trajectories
        return sa.select(t).where(t.c.namespace == namespace, t.c.source == ENGINE)

    def lookup(self, namespace: str, ids: Iterable[str]) -> dict[str, list[TrajectoryEntry]]:
        """Segments of the ids that exist, every source, in start order (missing ids
        are absent)."""
        wanted = list(dict.fromkeys(ids))
        found: dict[str, list[TrajectoryEntry]] = defaultdict(list)
        t = trajectories
        with self._connect() as conn:
            for begin in range(0, len(wanted), _BATCH):
                part = wanted[begin : begin + _BATCH]
                query = sa.select(t).where(t.c.namespace == namespace, t.c.trajectory_id.in_(part))
                for row in conn.execute(query.order_by(t.c.start, t.c.source)):
                    found[row.trajectory_id].append(_from_row(row))
        return dict(found)

    def by_group(self, namespace: str, group_id: str) -> list[TrajectoryEntry]:
        query = self._select(namespace).where(trajectories.c.group_id == group_id)
        return self._entries(query.order_by(trajectories.c.trajectory_id, trajectories.c.start))

    def by_versions(self, namespace: str, low: int, high: int) -> list[TrajectoryEntry]:
        """Segments with `low <= policy_version <= high`, oldest first."""
        query = self._select(namespace).where(trajectories.c.policy_version.between(low, high))
        return self._entries(
            query.order_by(trajectories.c.created_at, trajectories.c.trajectory_id)
        )

    def _entries(self, query: sa.Select[Any]) -> list[TrajectoryEntry]:
        with self._connect() as conn:
            return [_from_row(row) for row in conn.execute(query)]

    def count_by_version(self, namespace: str) -> dict[int, int]:
        """Trajectories by the policy version of their first segment."""
        t = trajectories
        query = (
            sa.select(t.c.policy_version, sa.func.count())
            .where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
            .group_by(t.c.policy_version)
            .order_by(t.c.policy_version)
        )
        with self._connect() as conn:
            return {int(v): int(n) for v, n in conn.execute(query)}

    def newest_version(self, namespace: str, nth: int = 1) -> int | None:
        """The `nth` newest (1: the newest) policy version that a segment of the
        namespace holds routes of; None when fewer versions do."""
        t = trajectories
        query = (
            sa.select(t.c.policy_version)
            .where(t.c.namespace == namespace)
            .distinct()
            .order_by(t.c.policy_version.desc())
            .limit(1)
            .offset(nth - 1)
        )
        with self._connect() as conn:
            found = conn.execute(query).scalar()
        return None if found is None else int(found)

    def count(self, namespace: str) -> int:
        """Trajectories (not segments) in the namespace."""
        query = sa.select(sa.func.count()).select_from(trajectories)
        t = trajectories
        query = query.where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        with self._connect() as conn:
            return int(conn.execute(query).scalar_one())

    def sampling_totals(self, namespace: str) -> tuple[int, int]:
        """Samplings of the namespace's trajectories, and trajectories sampled at all."""
        t = trajectories
        query = sa.select(
            sa.func.coalesce(sa.func.sum(t.c.times_sampled), 0),
            sa.func.count().filter(t.c.times_sampled > 0),
        ).where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        with self._connect() as conn:
            total, sampled = conn.execute(query).one()
        return int(total), int(sampled)

    def sampling_candidates(
        self, namespace: str, min_version: int | None, max_times: int | None
    ) -> list[tuple[str, str | None, float]]:
        """(id, group, created) of trajectories whose every segment is at or above
        `min_version` and that were sampled fewer than `max_times` times."""
        t = trajectories
        oldest = (
            sa.select(t.c.trajectory_id, sa.func.min(t.c.policy_version).label("oldest"))
            .where(t.c.namespace == namespace, t.c.source == ENGINE)
            .group_by(t.c.trajectory_id)
            .subquery()
        )
        query = (
            sa.select(t.c.trajectory_id, t.c.group_id, t.c.created_at)
            .join(oldest, oldest.c.trajectory_id == t.c.trajectory_id)
            .where(t.c.namespace == namespace, t.c.start == 0, t.c.source == ENGINE)
        )
        if min_version is not None:
            query = query.where(oldest.c.oldest >= min_version)
        if max_times is not None:
            query = query.where(t.c.times_sampled < max_times)
        with self._connect() as conn:
            return [(r.trajectory_id, r.group_id, r.created_at) for r in conn.execute(query)]

    def mark_sampled(self, namespace: str, ids: Sequence[str], max_times: int | None) -> list[str]:
        """Count one more sampling of each id still under `max_times`; returns those ids."""
        t = trajectories
        taken = []
        with self._begin() as conn:
            for tid in ids:
                query = t.update().where(
                    t.c.namespace == namespace,
                    t.c.trajectory_id == tid,
                    t.c.start == 0,
                    t.c.source == ENGINE,
                )
                if max_times is not None:
                    query = query.where(t.c.times_sampled < max_times)
                if conn.execute(query.values(times_sampled=t.c.times_sampled + 1)).rowcount:
                    taken.append(tid)
        return taken

    # API keys

    def add_key(self, name: str, role: str, namespaces: list[str], digest: bytes) -> None:
        """A new key. A revoked key's name may be taken again: its row, digest and all,
        gives way to the new one, so the old key stays unknown (refused) everywhere."""
        try:
            with self._begin() as conn:
                conn.execute(
                    api_keys.delete().where(
                        api_keys.c.name == name, api_keys.c.revoked_at.is_not(None)
                    )
                )
                conn.execute(
                    api_keys.insert().values(
                        name=name,
                        role=role,
                        namespaces=json.dumps(namespaces),
                        digest=digest,
                        created_at=time.time(),
                    )
                )
        except Conflict:
            raise Conflict(
                f"an active API key named {name!r} exists: revoke it first to reuse the name"
            ) from None

    def list_keys(self, active_only: bool = False) -> list[ApiKeyRecord]:
        query = sa.select(api_keys).order_by(api_keys.c.name)
        if active_only:
            query = query.where(api_keys.c.revoked_at.is_(None))
        with self._connect() as conn:
            return [
                ApiKeyRecord(
                    r.name, r.role, json.loads(r.namespaces), r.digest, r.created_at, r.revoked_at
                )
                for r in conn.execute(query)
            ]

    def revoke_key(self, name: str) -> None:
        with self._begin() as conn:
            done = conn.execute(
                api_keys.update()
                .where(api_keys.c.name == name, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
        if done.rowcount == 0:
            raise NotFound(f"no active API key named {name!r}")

    # retention and compaction

    def retention_victims(
        self,
        namespace: str,
        min_version: int | None,
        created_before: float | None,
        sampled_at_least: int | None,
    ) -> list[str]:
        """Trajectories to drop: a segment older than `min_version`, first stored before
        `created_before`, or sampled `sampled_at_least` times."""
        t = trajectories
        victims: set[str] = set()
        with self._connect() as conn:
            if min_version is not None:
                query = sa.select(t.c.trajectory_id).where(
                    t.c.namespace == namespace, t.c.policy_version < min_version
                )
                victims.update(conn.execute(query).scalars())
            first = self._select(namespace).with_only_columns(t.c.trajectory_id)
            first = first.where(t.c.start == 0)
            if created_before is not None:
                victims.update(conn.execute(first.where(t.c.created_at < created_before)).scalars())
            if sampled_at_least is not None:
                query = first.where(t.c.times_sampled >= sampled_at_least)
                victims.update(conn.execute(query).scalars())
        return sorted(victims)

    def delete_trajectories(
        self, namespace: str, ids: Sequence[str], shard_keys: Sequence[str] | None = None
    ) -> int:
        """Forget trajectories (all their segments); returns segments removed. With
        `shard_keys`, only trajectories all of whose segments are still in those shards:
        one with a segment a pass moved elsewhere since (into a shard a tombstone does
        not name yet) stays whole, for the next pass."""
        t = trajectories
        removed = 0
        with self._begin() as conn:
            for begin in range(0, len(ids), _BATCH):
                part = list(ids[begin : begin + _BATCH])
                query = t.delete().where(t.c.namespace == namespace, t.c.trajectory_id.in_(part))
                if shard_keys is not None:
                    other = t.alias("other")
                    elsewhere = sa.exists().where(
                        other.c.namespace == t.c.namespace,
                        other.c.trajectory_id == t.c.trajectory_id,
                        other.c.shard_key.not_in(list(shard_keys)),
                    )
                    query = query.where(~elsewhere)
                removed += conn.execute(query).rowcount
        return removed

    def shard_usage(self, namespace: str | None = None) -> list[ShardUsage]:
        """Live (not retired) shards with the rows and route bytes still pointing at them."""
        t, s = trajectories, shards
        live = (
            sa.select(
                t.c.shard_key,
                sa.func.count().label("rows"),
                sa.func.sum(t.c.route_bytes).label("bytes"),
            )
            .group_by(t.c.shard_key)
            .subquery()
        )
        query = (
            sa.select(s, live.c.rows, live.c.bytes)
            .select_from(s.outerjoin(live, live.c.shard_key == s.c.key))
            .where(s.c.retired_at.is_(None))
        )
        if namespace is not None:
            query = query.where(s.c.namespace == namespace)
        with self._connect() as conn:
            return [
                ShardUsage(
                    r.key,
                    r.namespace,
                    r.size,
                    r.route_bytes,
                    r.rows or 0,
                    int(r.bytes or 0),
                    r.created_at,
                    r.rest_level,
                )
                for r in conn.execute(query.order_by(s.c.created_at))
            ]

    def entries_in(self, key: str) -> list[TrajectoryEntry]:
        return self._entries(sa.select(trajectories).where(trajectories.c.shard_key == key))

    def replace_shards(
        self, old: Sequence[str], new: ShardInfo, entries: Sequence[TrajectoryEntry], now: float
    ) -> int:
        """Point the rows of shards `old` at `new` in one transaction, and retire `old`.

        The rows are taken with one `DELETE ... RETURNING`, which sees the latest state:
        when any of `entries` was dropped by retention or moved by a pass running
        elsewhere since they were read, nothing changes and `Conflict` is raised (the new
        object would hold rows the catalog no longer has, which a rebuild could bring
        back). The dictionaries the rows name are held in the same transaction, and a
        collected one refuses the switch too. Returns rows moved.
        """
        t = trajectories
        try:
            with self._begin() as conn:
                taken = conn.execute(
                    t.delete()
                    .where(t.c.shard_key.in_(old))
                    .returning(t.c.trajectory_id, t.c.source, t.c.start, t.c.dictionary)
                ).all()
                still = {(r.trajectory_id, r.source, r.start) for r in taken}
                wanted = {(e.trajectory_id, e.source, e.start) for e in entries}
                if still != wanted:
                    raise Conflict(
                        f"{len(wanted - still)} of its rows were dropped or moved meanwhile, "
                        f"{len(still - wanted)} added"
                    )
                # a dictionary the old rows named cannot have been collected (recorded
                # if an older server did not); one the pass chose must still be held
                named = {r.dictionary for r in taken if r.dictionary is not None}
                used = {e.spans.dictionary for e in entries if e.spans.dictionary is not None}
                for digest in named & used:
                    catalog_ledger.record(conn, new.namespace, digest, 0, now)
                if not catalog_ledger.hold(conn, new.namespace, used - named, now):
                    raise Conflict("a dictionary its rows use was collected meanwhile")
                if not catalog_ledger.unplan(conn, [new.key]):
                    raise Conflict(f"{new.key} was collected as an orphan meanwhile")
                self._insert(conn, new, list(entries))
                conn.execute(shards.update().where(shards.c.key.in_(old)).values(retired_at=now))
        except Conflict as exc:
            raise Conflict(f"rewriting {', '.join(old)} raced another pass: {exc}") from exc
        return len(entries)

    def dictionary_for(self, namespace: str, version: int) -> tuple[bytes, int] | None:
        """The dictionary of the newest policy version at or below `version` whose rows
        use one, and that version."""
        t = trajectories
        query = (
            sa.select(t.c.dictionary, t.c.policy_version)
            .where(
                t.c.namespace == namespace,
                t.c.dictionary.is_not(None),
                t.c.policy_version <= version,
            )
            .order_by(t.c.policy_version.desc())
            .limit(1)
        )
        with self._connect() as conn:
            row = conn.execute(query).first()
        return None if row is None else (row.dictionary, row.policy_version)

    def retire_empty(self, key: str, now: float) -> bool:
        """Retire a shard no row points at (checked in the same transaction)."""
        with self._begin() as conn:
            rows = conn.execute(
                sa.select(sa.func.count())
                .select_from(trajectories)
                .where(trajectories.c.shard_key == key)
            ).scalar_one()
            if rows:
                return False
            conn.execute(shards.update().where(shards.c.key == key).values(retired_at=now))
        return True

    def retired_before(self, cutoff: float) -> list[str]:
        query = sa.select(shards.c.key).where(shards.c.retired_at < cutoff)
        with self._connect() as conn:
            return list(conn.execute(query).scalars())

    def forget_shard(self, key: str) -> None:
        with self._begin() as conn:
            conn.execute(shards.delete().where(shards.c.key == key))

    def shard_keys(self) -> set[str]:
        with self._connect() as conn:
            return set(conn.execute(sa.select(shards.c.key)).scalars())

    # shards

    def shard(self, key: str) -> ShardInfo:
        with self._connect() as conn:
            row = conn.execute(sa.select(shards).where(shards.c.key == key)).first()
        if row is None:
            raise NotFound(f"no shard {key!r} in the catalog")
        return ShardInfo(**row._mapping)

    def commit_shard(
        self,
        shard: ShardInfo,
        entries: Sequence[TrajectoryEntry],
        loads: Sequence[LoadRecord] = (),
    ) -> None:
        """Record a stored shard, its rows and their expert load in one transaction:
        all visible, or none."""
        with self._begin() as conn:
            if not catalog_ledger.unplan(conn, [shard.key]):
                raise Conflict(f"{shard.key} was not planned, or was collected as an orphan")
            self._insert(conn, shard, entries)
            catalog_stats.insert_loads(conn, loads)

    # what the catalog owns in the store (r3store.storage.catalog.ledger)

    def identity(self) -> str | None:
        """The id this catalog is bound to its store with, or None when unbound."""
        with self._connect() as conn:
            return catalog_ledger.value(conn, catalog_ledger.IDENTITY)

    def bind_identity(self, catalog_id: str, replace: bool = False) -> str:
        """Record `catalog_id` as this catalog's identity unless it has one (another
        process's, recorded first, wins; `replace`: even then); returns the identity it
        has now."""
        with self._begin() as conn:
            if replace:
                catalog_ledger.set_value(conn, catalog_ledger.IDENTITY, catalog_id)
                return catalog_id
            catalog_ledger.insert_value(conn, catalog_ledger.IDENTITY, catalog_id)
        found = self.identity()
        assert found is not None
        return found

    def generation(self) -> int:
        """How many maintenance passes counted up this catalog's generation."""
        with self._connect() as conn:
            return int(catalog_ledger.value(conn, catalog_ledger.GENERATION) or 0)

    def advance_generation(self, seen: int) -> bool:
        """Count the generation up from `seen`; False when another pass did first."""
        with self._begin() as conn:
            return catalog_ledger.advance_generation(conn, seen)

    def is_empty(self) -> bool:
        """No namespace and no shard: a catalog nothing was ever written through."""
        with self._connect() as conn:
            for table in (namespaces, shards):
                if conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one():
                    return False
        return True

    def plan_upload(self, key: str, namespace: str, kind: str, now: float) -> None:
        """Record an upload before its object is written: only a planned upload that
        was never committed is an orphan this catalog may delete."""
        with self._begin() as conn:
            catalog_ledger.plan(conn, key, namespace, kind, now)

    def claim_orphan(self, key: str, cutoff: float) -> bool:
        """Take an upload planned before `cutoff` and never committed for deletion; a
        commit of it after this fails, so collection and a late commit never both win."""
        with self._begin() as conn:
            return catalog_ledger.claim_orphan(conn, key, cutoff)

    def forget_upload(self, key: str) -> None:
        """An upload abandoned, or an object deleted: off the ledger."""
        with self._begin() as conn:
            catalog_ledger.forget(conn, key)

    def pending_uploads(self, namespace: str | None = None) -> list[PlannedUpload]:
        with self._connect() as conn:
            return catalog_ledger.pending(conn, namespace)

    def dictionary_keys(self) -> set[str]:
        """The keys of every dictionary this catalog recorded."""
        with self._connect() as conn:
            return {dictionary_key(ns, digest) for ns, digest in catalog_ledger.keys_of(conn)}

    def record_dictionary(self, namespace: str, digest: bytes, version: int, now: float) -> bool:
        """A dictionary about to be stored: recorded (and held) before its object is;
        False when it is being deleted: do not use it."""
        with self._begin() as conn:
            return catalog_ledger.record(conn, namespace, digest, version, now)

    def hold_dictionary(self, namespace: str, digest: bytes, now: float) -> bool:
        """Hold a dictionary a pass is about to encode with; False when it is being (or
        was) collected: do not use it."""
        with self._begin() as conn:
            return catalog_ledger.hold(conn, namespace, {digest}, now)

    def unused_dictionaries(self, cutoff: float) -> list[tuple[str, bytes]]:
        """(namespace, digest) of recorded dictionaries no row names, last held before
        `cutoff` (or being deleted)."""
        with self._connect() as conn:
            return catalog_ledger.unused(conn, trajectories, cutoff)

    def start_dropping_dictionary(self, namespace: str, digest: bytes, cutoff: float) -> bool:
        """Mark a dictionary as being deleted if still unused and not held since
        `cutoff`; True when marked: its object may go, then `forget_dictionary`."""
        with self._begin() as conn:
            return catalog_ledger.start_drop(conn, trajectories, namespace, digest, cutoff)

    def forget_dictionary(self, namespace: str, digest: bytes) -> None:
        with self._begin() as conn:
            catalog_ledger.end_drop(conn, namespace, digest)

    # statistics (r3store.storage.catalog.stats)

    def expert_loads(
        self, namespace: str, source: str, shape: tuple[int, int], newest: int | None = None
    ) -> dict[int, tuple[int, Any]]:
        with self._connect() as conn:
            return catalog_stats.loads(conn, namespace, source, shape, newest)  # type: ignore[arg-type]

    def annotated_ids(self, namespace: str) -> list[str]:
        """Trajectories holding routes of a source other than engine."""
        t = trajectories
        query = (
            sa.select(t.c.trajectory_id)
            .where(t.c.namespace == namespace, t.c.source != ENGINE)
            .distinct()
            .order_by(t.c.trajectory_id)
        )
        with self._connect() as conn:
            return list(conn.execute(query).scalars())

    def add_agreements(self, records: Sequence[AgreementRecord]) -> None:
        with self._begin() as conn:
            catalog_stats.upsert_agreements(conn, records)

    def agreements(
        self, namespace: str, pair: tuple[str, str], num_layers: int, newest: int | None = None
    ) -> dict[int, tuple[int, int, Any]]:
        with self._connect() as conn:
            return catalog_stats.agreements(conn, namespace, pair, num_layers, newest)  # type: ignore[arg-type]

    @staticmethod
    def _insert(conn: Connection, shard: ShardInfo, entries: Sequence[TrajectoryEntry]) -> None:
        conn.execute(shards.insert().values(**shard.__dict__))
        if entries:
            conn.execute(trajectories.insert(), [_to_row(e) for e in entries])

    def replace_all(
        self,
        spaces: Sequence[NamespaceInfo],
        contents: Iterator[tuple[ShardInfo, list[TrajectoryEntry], list[LoadRecord]]],
        dictionaries: Sequence[tuple[str, bytes]] = (),
    ) -> None:
        """Empty the catalog and fill it again, in one transaction (used by rebuilds);
        `dictionaries` (namespace, digest) found in the store are recorded as this
        catalog's, so that those no row names are collected in time."""
        with self._begin() as conn:
            for table in (trajectories, shards, namespaces):
                conn.execute(table.delete())
            catalog_stats.delete_all(conn)
            catalog_ledger.delete_all(conn)
            for ns in spaces:
                conn.execute(
                    namespaces.insert().values(
                        name=ns.name,
                        spec=ns.spec.to_json(),
                        settings=ns.settings.model_dump_json(),
                        created_at=ns.created_at,
                        policy_version=ns.policy_version,
                    )
                )
            for shard, entries, loads in contents:
                self._insert(conn, shard, entries)
                catalog_stats.insert_loads(conn, loads)
            catalog_ledger.record_in_use(conn, trajectories, time.time())
            for namespace, digest in dictionaries:
                catalog_ledger.record(conn, namespace, digest, 0, time.time())


def _add_sources(engine: Engine) -> None:
    """Bring a catalog made before route sources up to date: its trajectory rows are
    engine routes, and the source joins the key. The table is made again under the
    new key and the rows copied, in one transaction."""
    inspector = sa.inspect(engine)
    if not inspector.has_table("trajectories"):
        return
    if "source" in {c["name"] for c in inspector.get_columns("trajectories")}:
        return
    old = [c["name"] for c in inspector.get_columns("trajectories")]
    listed = ", ".join(old)
    key = inspector.get_pk_constraint("trajectories").get("name")
    with engine.begin() as conn:
        if key and engine.dialect.name != "sqlite":  # named per schema in PostgreSQL
            conn.execute(sa.text(f"ALTER TABLE trajectories DROP CONSTRAINT {key}"))
        for index in inspector.get_indexes("trajectories"):
            conn.execute(sa.text(f"DROP INDEX {index['name']}"))
        conn.execute(sa.text("ALTER TABLE trajectories RENAME TO trajectories_before_sources"))
        trajectories.create(conn)
        conn.execute(
            sa.text(
                f"INSERT INTO trajectories ({listed}, source) "
                f"SELECT {listed}, '{ENGINE}' FROM trajectories_before_sources"
            )
        )
        conn.execute(sa.text("DROP TABLE trajectories_before_sources"))


def _add_columns(engine: Engine) -> None:
    """Bring a catalog made before compression at rest up to date: the columns it lacks
    are added (empty: no dictionary, no shared prefix)."""
    inspector = sa.inspect(engine)
    with engine.begin() as conn:
        for table in (trajectories, shards):
            if not inspector.has_table(table.name):
                continue
            present = {c["name"] for c in inspector.get_columns(table.name)}
            for column in table.columns:
                if column.name in present:
                    continue
                kind = column.type.compile(dialect=engine.dialect)
                default = column.server_default
                if default is not None:  # a literal: the value rows made before it hold
                    kind += f" NOT NULL DEFAULT '{default.arg}'"  # type: ignore[attr-defined]
                conn.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
