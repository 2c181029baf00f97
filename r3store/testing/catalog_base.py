"""What the catalog's conformance checks (`r3store.testing.catalog`) share: the
namespace's spec, the rows and shards they commit, and the backdoors a database's suite
provides to read and write around the catalog under test."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from r3store.catalog_types import ShardInfo, TrajectoryEntry
from r3store.policy import ENGINE, Source
from r3store.spans import RouteSpans, Span
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.ledger import INGEST

SPEC = RouteSpec(2, 8, 2)


def entry(
    tid: str,
    shard: str,
    *,
    start: int = 0,
    group: str | None = None,
    version: int = 0,
    source: Source = ENGINE,
    created: float = 1.0,
    dictionary: bytes | None = None,
) -> TrajectoryEntry:
    spans = RouteSpans(Span(10, 20), Span(30, 4), None, 1, Span(40, 8), dictionary)
    return TrajectoryEntry(
        "ns",
        tid,
        start,
        group,
        version,
        6,
        2,
        bytes(16),
        100,
        shard,
        0,
        0,
        created,
        spans,
        source=source,
    )


def shard(key: str, rows: int = 1, created: float = 1.0) -> ShardInfo:
    return ShardInfo(key, "ns", 1000, rows, 100 * rows, created)


class CatalogBackdoors(ABC):
    """Reads and writes around the catalog, which a database's suite provides."""

    @abstractmethod
    def raw_query(
        self, catalog: Catalog, sql: str, params: Sequence[Any] = ()
    ) -> list[tuple[Any, ...]]:
        """The rows `sql` selects, read around the catalog."""

    @abstractmethod
    def raw_execute(self, catalog: Catalog, sql: str, params: Sequence[Any] = ()) -> None:
        """Run `sql` around the catalog, committed."""

    def commit(self, catalog: Catalog, info: ShardInfo, entries: Sequence[TrajectoryEntry]) -> None:
        catalog.ledger.plan_upload(info.key, info.namespace, INGEST, 0.0)
        catalog.shards.commit(info, entries)
