"""The catalog's ledger of what it owns in the object store, on SQLAlchemy Core.
`r3store.catalog` creates these tables and writes them in its own transactions; the
functions here take its connection.

- `catalog_meta`: the catalog's identity (`catalog_id`), the same one the store's
  identity object holds (`r3store.binding`): a catalog works on one store prefix only.
- `uploads`: every shard upload this catalog planned and has not committed yet, written
  *before* the object is: an uncommitted object is an orphan maintenance may delete
  only when it is listed here, so a second, empty or stale catalog pointed at the same
  bucket never deletes another's shards. `kind` says who planned it (`ingest` or
  `maintenance`): a maintenance upload may hold copies of rows retention dropped since,
  so tombstones of its namespace are kept while one is pending.
- `dictionaries`: the zstd dictionaries this catalog stored or uses, with when a pass
  last held one (`used_at`). A pass holds a dictionary before it encodes rows with it and
  again in the transaction that commits those rows; collection deletes a dictionary's
  row (no trajectory naming it, not held for the orphan age) before its object, so a
  pass never commits rows whose dictionary is being deleted.
"""

from __future__ import annotations

from dataclasses import dataclass

import sqlalchemy as sa
from sqlalchemy.engine import Connection

metadata = sa.MetaData()

INGEST = "ingest"
MAINTENANCE = "maintenance"

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

_IDENTITY = "catalog_id"


@dataclass(frozen=True)
class PlannedUpload:
    key: str
    namespace: str
    kind: str
    planned_at: float


def identity(conn: Connection) -> str | None:
    query = sa.select(catalog_meta.c.value).where(catalog_meta.c.key == _IDENTITY)
    found: str | None = conn.execute(query).scalar_one_or_none()
    return found


def set_identity(conn: Connection, catalog_id: str) -> None:
    conn.execute(catalog_meta.delete().where(catalog_meta.c.key == _IDENTITY))
    conn.execute(catalog_meta.insert().values(key=_IDENTITY, value=catalog_id))


def plan(conn: Connection, key: str, namespace: str, kind: str, now: float) -> None:
    conn.execute(uploads.insert().values(key=key, namespace=namespace, kind=kind, planned_at=now))


def settle(conn: Connection, keys: list[str]) -> int:
    """The uploads of `keys` are committed (or abandoned): no longer pending. Returns how
    many were: a commit whose plan is gone (collected as an orphan) must not proceed."""
    return int(conn.execute(uploads.delete().where(uploads.c.key.in_(keys))).rowcount)


def pending(conn: Connection, namespace: str | None = None) -> list[PlannedUpload]:
    query = sa.select(uploads).order_by(uploads.c.planned_at)
    if namespace is not None:
        query = query.where(uploads.c.namespace == namespace)
    return [PlannedUpload(r.key, r.namespace, r.kind, r.planned_at) for r in conn.execute(query)]


def hold(conn: Connection, namespace: str, digests: set[bytes], now: float) -> bool:
    """Mark the dictionaries `digests` as used now; False when one has no row (collected
    meanwhile, or never recorded): rows encoded with it must not be committed."""
    if not digests:
        return True
    done = conn.execute(
        dictionaries.update()
        .where(dictionaries.c.namespace == namespace, dictionaries.c.digest.in_(digests))
        .values(used_at=now)
    )
    return bool(done.rowcount == len(digests))


def record(conn: Connection, namespace: str, digest: bytes, version: int, now: float) -> None:
    """A dictionary about to be stored (or stored again): recorded and held."""
    if not hold(conn, namespace, {digest}, now):
        conn.execute(
            dictionaries.insert().values(
                namespace=namespace, digest=digest, policy_version=version, used_at=now
            )
        )


def delete_namespace(conn: Connection, namespace: str) -> None:
    """A namespace deleted with every object of it: nothing of it is pending or held."""
    conn.execute(uploads.delete().where(uploads.c.namespace == namespace))
    conn.execute(dictionaries.delete().where(dictionaries.c.namespace == namespace))


def delete_all(conn: Connection) -> None:
    """Everything but the identity (a rebuild records what it finds again)."""
    conn.execute(uploads.delete())
    conn.execute(dictionaries.delete())
