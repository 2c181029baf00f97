"""The catalog: what the store holds, in SQLite or PostgreSQL (`database`: `Catalog`),
with the ledger of what it owns in the store (`ledger`) and its statistics tables
(`stats`)."""

from r3store.storage.catalog.database import Catalog, metadata

__all__ = ["Catalog", "metadata"]
