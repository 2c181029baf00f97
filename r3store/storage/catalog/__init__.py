"""The catalog: what the store holds, in SQLite or PostgreSQL.

`Catalog` (`catalog`) holds the `Database` (`database`: connections, the error
boundary, rows) and the repositories: `namespaces`, `segments`, `shards`, `keys`,
`stats`, `ledger`, `leases`, `checkpoints` (the last two share `consumption`). The
tables are in `tables`; their versions, Alembic revisions, in `migrations`, applied by
`migrate`.
"""

from r3store.storage.catalog.catalog import Catalog
from r3store.storage.catalog.migrate import Plan, head, plan_at, upgrade_at
from r3store.storage.catalog.tables import metadata

__all__ = ["Catalog", "Plan", "head", "metadata", "plan_at", "upgrade_at"]
