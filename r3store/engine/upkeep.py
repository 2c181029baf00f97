"""Upkeep, the engine's part for its store and catalog as a pair (`Engine.upkeep`):
the passes of maintenance (`maintenance`), the check that the two belong together
(`bind`), and the catalog made again from the store (`rebuild`). What the server's
background pass, the operator's CLI and tests need; no part of a request's data path.

    engine.upkeep.bind(create=True)
    engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from r3store.engine.analytics import Analytics
from r3store.engine.maintenance import Maintenance, MaintenanceOptions
from r3store.engine.namespaces import Namespaces
from r3store.engine.rebuild import RebuildReport, rebuild_catalog
from r3store.storage import binding
from r3store.storage.catalog import Catalog
from r3store.storage.store.base import ObjectStore


@dataclass(eq=False)
class Upkeep:
    store: ObjectStore
    catalog: Catalog
    namespaces: Namespaces
    analytics: Analytics
    row_group_bytes: int  # the writer's, for the shards maintenance writes

    def maintenance(self, options: MaintenanceOptions | None = None) -> Maintenance:
        """Retention, compaction and collection over the store and the catalog."""
        return Maintenance(
            self.store,
            self.catalog,
            self.namespaces.spec,
            options,
            row_group_bytes=self.row_group_bytes,
        )

    def bind(self, create: bool, where: str = "") -> str:
        """Check that the store and the catalog belong together (`r3store.storage.binding`);
        a new, empty pair is bound only when `create`. `InvalidConfig` when they do not
        belong together; returns their id. The server and the CLI call it on open."""
        return binding.bind(self.store, self.catalog, create=create, where=where)

    def rebuild(self, progress: Callable[[int, int], None] | None = None) -> RebuildReport:
        """Make the catalog again from the object store alone (the source of truth); the
        catalog takes the store's identity."""
        self.namespaces.forget_specs()
        report = rebuild_catalog(self.store, self.catalog, progress)
        binding.adopt(self.store, self.catalog)
        for info in self.catalog.namespaces.all():
            self.analytics.compare_all(info.name)
        return report
