"""Upkeep, the engine's part for its store and catalog as a pair (`Engine.upkeep`):
the passes of maintenance (`maintenance`), the check that the two belong together
(`bind`), and the catalog made again from the store (`rebuild`). What the server's
background pass, the operator's CLI and tests need; no part of a request's data path.

    engine.upkeep.bind(create=True)
    engine.upkeep.maintenance(MaintenanceOptions(grace_seconds=0)).run()
"""

from __future__ import annotations

from collections.abc import Callable

from r3store.engine.analytics import Analytics
from r3store.engine.maintenance import Maintenance, MaintenanceOptions
from r3store.engine.namespaces import Namespaces
from r3store.engine.rebuild import RebuildReport, rebuild_catalog
from r3store.storage import binding
from r3store.storage.catalog import Catalog
from r3store.storage.store.base import ObjectStore


class Upkeep:
    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        namespaces: Namespaces,
        analytics: Analytics,
        row_group_bytes: int,
    ) -> None:
        """`row_group_bytes`: the writer's, for the shards maintenance writes."""
        self._store = store
        self._catalog = catalog
        self._namespaces = namespaces
        self._analytics = analytics
        self._row_group_bytes = row_group_bytes

    def maintenance(self, options: MaintenanceOptions | None = None) -> Maintenance:
        """Retention, compaction and collection over the store and the catalog."""
        return Maintenance(
            self._store,
            self._catalog,
            self._namespaces.spec,
            options,
            row_group_bytes=self._row_group_bytes,
        )

    def bind(self, create: bool, where: str = "") -> str:
        """Check that the store and the catalog belong together (`r3store.storage.binding`);
        a new, empty pair is bound only when `create`. `InvalidConfig` when they do not
        belong together; returns their id. The server and the CLI call it on open."""
        return binding.bind(self._store, self._catalog, create=create, where=where)

    def rebuild(self, progress: Callable[[int, int], None] | None = None) -> RebuildReport:
        """Make the catalog again from the object store alone (the source of truth); the
        catalog takes the store's identity."""
        self._namespaces.forget_specs()
        report = rebuild_catalog(self._store, self._catalog, progress)
        binding.adopt(self._store, self._catalog)
        for info in self._catalog.namespaces.all():
            self._analytics.compare_all(info.name)
        return report
