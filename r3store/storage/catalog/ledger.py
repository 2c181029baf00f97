"""The catalog's ledger of what it owns in the object store: `Ledger`, the repository
(`catalog.ledger`), over functions that take a connection, which the other repositories
call in their own transactions (a commit unplans its upload and holds its dictionaries).
The tables (`r3store.storage.catalog.tables`):

- `catalog_meta`: the catalog's identity (`catalog_id`), the same one the store's
  identity object holds (`r3store.storage.binding`): a catalog works on one store prefix only;
  and its `generation`, counted up by every maintenance pass and mirrored in the store,
  so that a catalog older than its store (restored from a backup) deletes nothing.
- `uploads`: every object upload this catalog planned and has not committed yet, written
  *before* the object is: an uncommitted object is an orphan maintenance may delete
  only when it is listed here, so a second, empty or stale catalog pointed at the same
  bucket never deletes another's shards. `kind` says who planned it: `ingest`,
  `direct` (a write plan: the worker uploads the object, the server checks it),
  `maintenance` (which may hold copies of rows retention dropped since, so tombstones
  of its namespace are kept while one is pending), or `deleting` (an object whose
  deletion is under way: a commit of it is refused, and collection finishes it).
- `dictionaries`: the zstd dictionaries this catalog stored or uses, with when a pass
  last held one (`used_at`; `DROPPING` while collection deletes it). A pass holds a
  dictionary before it encodes rows with it and again in the transaction that commits
  those rows; collection first marks a dictionary no row names and no pass held for the
  orphan age (one statement), then deletes its object, then its row: a pass never
  holds, records or commits with a dictionary being deleted.

`catalog_meta` also keeps the secret that signs write plans (`secret`), shared by the
replicas of one catalog.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable
from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection
from sqlalchemy.exc import IntegrityError

from r3store.storage.catalog.database import Repository, lock_name
from r3store.storage.catalog.tables import (
    catalog_meta,
    dictionaries,
    namespaces,
    shards,
    trajectories,
    uploads,
)
from r3store.storage.keys import dictionary_key

INGEST = "ingest"
DIRECT = "direct"  # a blob a rollout worker uploads itself (a write plan)
MAINTENANCE = "maintenance"
DELETING = "deleting"
DROPPING = -1.0  # a dictionary's `used_at` while collection deletes it

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


def plan(
    conn: Connection, key: str, namespace: str, kind: str, now: float, writer: str | None = None
) -> None:
    conn.execute(
        uploads.insert().values(
            key=key, namespace=namespace, kind=kind, planned_at=now, writer=writer
        )
    )


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


def _named() -> sa.Exists:
    t, d = trajectories, dictionaries
    return sa.exists().where(t.c.namespace == d.c.namespace, t.c.dictionary == d.c.digest)


def unused(conn: Connection, cutoff: float) -> list[tuple[str, bytes]]:
    """(namespace, digest) of dictionaries no row names, not held since `cutoff` (or
    already being deleted)."""
    d = dictionaries
    query = sa.select(d.c.namespace, d.c.digest).where(d.c.used_at < cutoff, ~_named())
    return [(r.namespace, r.digest) for r in conn.execute(query)]


def start_drop(conn: Connection, namespace: str, digest: bytes, cutoff: float) -> bool:
    """Mark a dictionary as being deleted if still unused and not held since `cutoff`,
    checked in the one statement that marks it; True when marked: its object may go."""
    d = dictionaries
    done = conn.execute(
        d.update()
        .where(
            d.c.namespace == namespace,
            d.c.digest == digest,
            d.c.used_at < cutoff,
            ~_named(),
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


def record_in_use(conn: Connection, now: float) -> None:
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


class Ledger(Repository):
    """What the catalog owns in the store: its identity and generation, the uploads it
    planned, the dictionaries it holds (`catalog.ledger`)."""

    # identity and generation

    def identity(self) -> str | None:
        """The id this catalog is bound to its store with, or None when unbound."""
        with self._db.connect() as conn:
            return value(conn, IDENTITY)

    def bind_identity(self, catalog_id: str, replace: bool = False) -> str:
        """Record `catalog_id` as this catalog's identity unless it has one (another
        process's, recorded first, wins; `replace`: even then); returns the identity it
        has now."""
        with self._db.begin() as conn:
            if replace:
                set_value(conn, IDENTITY, catalog_id)
                return catalog_id
            insert_value(conn, IDENTITY, catalog_id)
        found = self.identity()
        assert found is not None
        return found

    def generation(self) -> int:
        """How many maintenance passes counted up this catalog's generation."""
        with self._db.connect() as conn:
            return int(value(conn, GENERATION) or 0)

    def advance_generation(self, seen: int) -> bool:
        """Count the generation up from `seen`; False when another pass did first."""
        with self._db.begin() as conn:
            return advance_generation(conn, seen)

    def is_empty(self) -> bool:
        """No namespace and no shard: a catalog nothing was ever written through."""
        with self._db.connect() as conn:
            for table in (namespaces, shards):
                if conn.execute(sa.select(sa.func.count()).select_from(table)).scalar_one():
                    return False
        return True

    def secret(self, name: str) -> bytes:
        """A random secret this catalog keeps under `name` (made by whichever process
        asks first; replicas sharing the catalog read the same one)."""
        with self._db.begin() as conn:
            found = value(conn, name)
            if found is None:
                insert_value(conn, name, secrets.token_hex(32))
                found = value(conn, name)
        assert found is not None
        return bytes.fromhex(found)

    # uploads

    def plan_upload(self, key: str, namespace: str, kind: str, now: float) -> None:
        """Record an upload before its object is written: only a planned upload that
        was never committed is an orphan this catalog may delete."""
        with self._db.begin() as conn:
            plan(conn, key, namespace, kind, now)

    def plan_uploads(
        self,
        keys: list[str],
        namespace: str,
        kind: str,
        now: float,
        writer: str | None = None,
        most: int | None = None,
        at: float | None = None,
    ) -> list[str]:
        """`plan_upload` of several keys, in one transaction, for the API key `writer`;
        returns those planned. With `most`, `writer` holds at most that many uploads
        planned, not committed and not expired at `at` (planned as of when their URLs
        stop working): the keys past it are not planned."""
        with self._db.begin() as conn:
            if most is not None and writer is not None:
                lock_name(conn, f"writer:{writer}")  # replicas count one key's in turns
                held = conn.execute(
                    sa.select(sa.func.count())
                    .select_from(uploads)
                    .where(uploads.c.writer == writer, uploads.c.planned_at > (at or 0.0))
                ).scalar_one()
                keys = keys[: max(0, most - int(held))]
            for key in keys:
                plan(conn, key, namespace, kind, now, writer)
        return keys

    def claim_orphan(self, key: str, cutoff: float) -> bool:
        """Take an upload planned before `cutoff` and never committed for deletion; a
        commit of it after this fails, so collection and a late commit never both win."""
        with self._db.begin() as conn:
            return claim_orphan(conn, key, cutoff)

    def forget_upload(self, key: str) -> None:
        """An upload abandoned, or an object deleted: off the ledger."""
        with self._db.begin() as conn:
            forget(conn, key)

    def is_planned(self, key: str, kind: str) -> bool:
        """Whether `key` is a planned upload of `kind`, not committed or being deleted."""
        query = sa.select(uploads.c.key).where(uploads.c.key == key, uploads.c.kind == kind)
        with self._db.connect() as conn:
            return conn.execute(query).first() is not None

    def pending_uploads(self, namespace: str | None = None) -> list[PlannedUpload]:
        with self._db.connect() as conn:
            return pending(conn, namespace)

    # dictionaries

    def newest_dictionary(self, namespace: str) -> bytes | None:
        """The digest of the namespace's dictionary of the highest policy version (not
        being deleted), or None."""
        d = dictionaries
        query = (
            sa.select(d.c.digest)
            .where(d.c.namespace == namespace, d.c.used_at != DROPPING)
            .order_by(d.c.policy_version.desc(), d.c.used_at.desc())
            .limit(1)
        )
        with self._db.connect() as conn:
            found: bytes | None = conn.execute(query).scalar_one_or_none()
        return found

    def dictionary_keys(self) -> set[str]:
        """The keys of every dictionary this catalog recorded."""
        with self._db.connect() as conn:
            return {dictionary_key(ns, digest) for ns, digest in keys_of(conn)}

    def record_dictionary(self, namespace: str, digest: bytes, version: int, now: float) -> bool:
        """A dictionary about to be stored: recorded (and held) before its object is;
        False when it is being deleted: do not use it."""
        with self._db.begin() as conn:
            return record(conn, namespace, digest, version, now)

    def hold_dictionary(self, namespace: str, digest: bytes, now: float) -> bool:
        """Hold a dictionary a pass is about to encode with; False when it is being (or
        was) collected: do not use it."""
        with self._db.begin() as conn:
            return hold(conn, namespace, {digest}, now)

    def unused_dictionaries(self, cutoff: float) -> list[tuple[str, bytes]]:
        """(namespace, digest) of recorded dictionaries no row names, last held before
        `cutoff` (or being deleted)."""
        with self._db.connect() as conn:
            return unused(conn, cutoff)

    def start_dropping_dictionary(self, namespace: str, digest: bytes, cutoff: float) -> bool:
        """Mark a dictionary as being deleted if still unused and not held since
        `cutoff`; True when marked: its object may go, then `forget_dictionary`."""
        with self._db.begin() as conn:
            return start_drop(conn, namespace, digest, cutoff)

    def forget_dictionary(self, namespace: str, digest: bytes) -> None:
        with self._db.begin() as conn:
            end_drop(conn, namespace, digest)
