"""The catalog's ledger of what it owns in the object store, on SQLAlchemy Core.
`r3store.storage.catalog` creates these tables and calls these functions in its own transactions
(with its `trajectories` table where a dictionary's use is checked).

- `catalog_meta`: the catalog's identity (`catalog_id`), the same one the store's
  identity object holds (`r3store.storage.binding`): a catalog works on one store prefix only;
  and its `generation`, counted up by every maintenance pass and mirrored in the store,
  so that a catalog older than its store (restored from a backup) deletes nothing.
- `uploads`: every object upload this catalog planned and has not committed yet, written
  *before* the object is: an uncommitted object is an orphan maintenance may delete
  only when it is listed here, so a second, empty or stale catalog pointed at the same
  bucket never deletes another's shards. `kind` says who planned it: `ingest`,
  `maintenance` (which may hold copies of rows retention dropped since, so tombstones
  of its namespace are kept while one is pending), or `deleting` (an object whose
  deletion is under way: a commit of it is refused, and collection finishes it).
- `dictionaries`: the zstd dictionaries this catalog stored or uses, with when a pass
  last held one (`used_at`; `DROPPING` while collection deletes it). A pass holds a
  dictionary before it encodes rows with it and again in the transaction that commits
  those rows; collection first marks a dictionary no row names and no pass held for the
  orphan age (one statement), then deletes its object, then its row: a pass never
  holds, records or commits with a dictionary being deleted.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

metadata = sa.MetaData()

INGEST = "ingest"
MAINTENANCE = "maintenance"
DELETING = "deleting"
DROPPING = -1.0  # a dictionary's `used_at` while collection deletes it

catalog_meta = sa.Table(
    "catalog_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)

uploads = sa.Table(
    "uploads",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("namespace", sa.String(128), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("planned_at", sa.Float, nullable=False),
)

dictionaries = sa.Table(
    "dictionaries",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("digest", sa.LargeBinary(16), primary_key=True),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("used_at", sa.Float, nullable=False),
)

IDENTITY = "catalog_id"
GENERATION = "generation"


@dataclass(frozen=True)
class PlannedUpload:
    key: str
    namespace: str
    kind: str
    planned_at: float


# the catalog's own values


def value(conn: Connection, key: str) -> str | None:
    query = sa.select(catalog_meta.c.value).where(catalog_meta.c.key == key)
    found: str | None = conn.execute(query).scalar_one_or_none()
    return found


def set_value(conn: Connection, key: str, new: str) -> None:
    conn.execute(catalog_meta.delete().where(catalog_meta.c.key == key))
    conn.execute(catalog_meta.insert().values(key=key, value=new))


def insert_value(conn: Connection, key: str, new: str) -> bool:
    """Set `key` unless it has a value (another process's insert wins); True if set."""
    try:
        with conn.begin_nested():
            conn.execute(catalog_meta.insert().values(key=key, value=new))
    except IntegrityError:
        return False
    return True


def advance_generation(conn: Connection, seen: int) -> bool:
    """Count the generation up from `seen`; False when another pass did first."""
    if value(conn, GENERATION) is None:
        return insert_value(conn, GENERATION, str(seen + 1)) if seen == 0 else False
    done = conn.execute(
        catalog_meta.update()
        .where(catalog_meta.c.key == GENERATION, catalog_meta.c.value == str(seen))
        .values(value=str(seen + 1))
    )
    return bool(done.rowcount)


# uploads


def plan(conn: Connection, key: str, namespace: str, kind: str, now: float) -> None:
    conn.execute(uploads.insert().values(key=key, namespace=namespace, kind=kind, planned_at=now))


def unplan(conn: Connection, keys: list[str]) -> int:
    """The uploads of `keys` are committed: no longer pending. Returns how many were; a
    commit whose plan is gone or being deleted (collected as an orphan) must not go on."""
    query = uploads.delete().where(uploads.c.key.in_(keys), uploads.c.kind != DELETING)
    return int(conn.execute(query).rowcount)


def mark_deleting(conn: Connection, keys: Iterable[str], namespace: str) -> None:
    """Objects whose deletion starts now (their catalog rows forgotten meanwhile): listed
    until the object is gone, so that a crash between leaves nothing unknown."""
    keys = list(keys)
    if not keys:
        return
    conn.execute(uploads.delete().where(uploads.c.key.in_(keys)))
    rows = [{"key": k, "namespace": namespace, "kind": DELETING, "planned_at": 0.0} for k in keys]
    conn.execute(uploads.insert(), rows)


def claim_orphan(conn: Connection, key: str, cutoff: float) -> bool:
    """Take a planned upload older than `cutoff` for deletion (a late commit of it is
    refused from now on); True when taken."""
    done = conn.execute(
        uploads.update()
        .where(uploads.c.key == key, uploads.c.planned_at < cutoff)
        .values(kind=DELETING)
    )
    return bool(done.rowcount)


def forget(conn: Connection, key: str) -> None:
    conn.execute(uploads.delete().where(uploads.c.key == key))


def pending(conn: Connection, namespace: str | None = None) -> list[PlannedUpload]:
    query = sa.select(uploads).order_by(uploads.c.planned_at)
    if namespace is not None:
        query = query.where(uploads.c.namespace == namespace)
    return [PlannedUpload(r.key, r.namespace, r.kind, r.planned_at) for r in conn.execute(query)]


# dictionaries


def hold(conn: Connection, namespace: str, digests: set[bytes], now: float) -> bool:
    """Mark the dictionaries `digests` as used now; False when one has no row, or is being
    deleted: rows encoded with it must not be committed."""
    if not digests:
        return True
    d = dictionaries
    done = conn.execute(
        d.update()
        .where(d.c.namespace == namespace, d.c.digest.in_(digests), d.c.used_at != DROPPING)
        .values(used_at=now)
    )
    return bool(done.rowcount == len(digests))


def record(conn: Connection, namespace: str, digest: bytes, version: int, now: float) -> bool:
    """A dictionary about to be stored, or found in use: recorded and held. False when it
    is being deleted (or another process recorded it at the same moment and it cannot
    be held): do not use it."""
    if hold(conn, namespace, {digest}, now):
        return True
    row = {"namespace": namespace, "digest": digest, "policy_version": version, "used_at": now}
    try:
        with conn.begin_nested():
            conn.execute(dictionaries.insert().values(**row))
    except IntegrityError:  # a row: being deleted, or another pass's just now
        return hold(conn, namespace, {digest}, now)
    return True


def _named(trajectories: sa.Table) -> sa.Exists:
    t, d = trajectories, dictionaries
    return sa.exists().where(t.c.namespace == d.c.namespace, t.c.dictionary == d.c.digest)


def unused(conn: Connection, trajectories: sa.Table, cutoff: float) -> list[tuple[str, bytes]]:
    """(namespace, digest) of dictionaries no row names, not held since `cutoff` (or
    already being deleted)."""
    d = dictionaries
    query = sa.select(d.c.namespace, d.c.digest).where(d.c.used_at < cutoff, ~_named(trajectories))
    return [(r.namespace, r.digest) for r in conn.execute(query)]


def start_drop(
    conn: Connection, trajectories: sa.Table, namespace: str, digest: bytes, cutoff: float
) -> bool:
    """Mark a dictionary as being deleted if still unused and not held since `cutoff`,
    checked in the one statement that marks it; True when marked: its object may go."""
    d = dictionaries
    done = conn.execute(
        d.update()
        .where(
            d.c.namespace == namespace,
            d.c.digest == digest,
            d.c.used_at < cutoff,
            ~_named(trajectories),
        )
        .values(used_at=DROPPING)
    )
    return bool(done.rowcount)


def end_drop(conn: Connection, namespace: str, digest: bytes) -> None:
    d = dictionaries
    conn.execute(
        d.delete().where(d.c.namespace == namespace, d.c.digest == digest, d.c.used_at == DROPPING)
    )


def keys_of(conn: Connection, namespace: str | None = None) -> list[tuple[str, bytes]]:
    query = sa.select(dictionaries.c.namespace, dictionaries.c.digest)
    if namespace is not None:
        query = query.where(dictionaries.c.namespace == namespace)
    return [(r.namespace, r.digest) for r in conn.execute(query)]


def record_in_use(conn: Connection, trajectories: sa.Table, now: float) -> None:
    """Record every dictionary a row names (a catalog made before the ledger, rebuilt,
    or written by an older server meanwhile), with the oldest policy version naming it."""
    t = trajectories
    query = (
        sa.select(t.c.namespace, t.c.dictionary, sa.func.min(t.c.policy_version).label("v"))
        .where(t.c.dictionary.is_not(None))
        .group_by(t.c.namespace, t.c.dictionary)
    )
    for row in conn.execute(query).all():
        record(conn, row.namespace, row.dictionary, row.v, now)


def delete_namespace(conn: Connection, namespace: str) -> None:
    """A namespace deleted: none of its dictionaries is held any more."""
    conn.execute(dictionaries.delete().where(dictionaries.c.namespace == namespace))


def delete_all(conn: Connection) -> None:
    """Everything but the identity and the generation (a rebuild records what it finds
    again)."""
    conn.execute(uploads.delete())
    conn.execute(dictionaries.delete())
