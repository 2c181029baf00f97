"""`Catalog`: one catalog database and its repositories.

    catalog = Catalog("sqlite:///catalog.db")   # upgrades the schema on open
    catalog.namespaces.get("ns"); catalog.segments.lookup("ns", ids)
    catalog.shards.commit(...); catalog.keys.all(); catalog.stats.agreements(...)
    catalog.ledger.identity(); catalog.leases.take(...); catalog.checkpoints.resume("ns", 10, now)

The object store is the source of truth: `r3store.engine.rebuild` can make the catalog
again from the shards alone (policy versions, settings, sampling counts, leases,
checkpoints and API keys live only here).
"""

from __future__ import annotations

from r3store.storage.catalog import migrate
from r3store.storage.catalog.checkpoints import Checkpoints
from r3store.storage.catalog.database import Database
from r3store.storage.catalog.keys import Keys
from r3store.storage.catalog.leases import Leases
from r3store.storage.catalog.ledger import Ledger
from r3store.storage.catalog.namespaces import Namespaces
from r3store.storage.catalog.segments import Segments
from r3store.storage.catalog.shards import Shards
from r3store.storage.catalog.stats import Stats


class Catalog:
    """The catalog's repositories over one database. Thread-safe: each call takes its
    own connection from the pool."""

    namespaces: Namespaces
    segments: Segments
    shards: Shards
    keys: Keys
    stats: Stats
    ledger: Ledger
    leases: Leases
    checkpoints: Checkpoints

    def __init__(self, url: str, timeout: float = 10.0, upgrade: bool = True) -> None:
        """Open the catalog at `url` (any SQLAlchemy URL; SQLite and PostgreSQL are
        tested). `timeout` bounds each wait on the database; past it a call raises
        `StoreError`. `upgrade`: bring the schema to the newest revision
        (`r3store.storage.catalog.migrate`); otherwise a catalog not at it is refused
        with `InvalidConfig`. A catalog newer than this code is refused either way."""
        self.url = url
        self.db = Database(url, timeout)
        try:
            if upgrade:
                migrate.upgrade(self.db)
            else:
                migrate.check(self.db)
        except BaseException:  # no pool left behind by a catalog that could not open
            self.db.close()
            raise
        self.namespaces = Namespaces(self.db)
        self.segments = Segments(self.db)
        self.shards = Shards(self.db)
        self.keys = Keys(self.db)
        self.stats = Stats(self.db)
        self.ledger = Ledger(self.db)
        self.leases = Leases(self.db)
        self.checkpoints = Checkpoints(self.db)

    def ping(self) -> None:
        """Raises `StoreError` when the database does not answer."""
        self.db.ping()

    def close(self) -> None:
        self.db.close()
