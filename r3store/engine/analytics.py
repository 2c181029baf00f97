"""Route analytics over the catalog and the stored routes: expert load per policy
version, agreement between route sources and drift between versions. (The expert load
of chosen trajectories is counted from their routes as read: `stats.expert_load`.)

Expert load is counted at ingest (`Encoder.prepare`) and committed with the shard.
Agreement is measured once both sources of a segment are stored: after each commit that
stores routes of a source other than `engine`, against every other source of the same
segment (so whichever commit lands last measures it), and again by `Engine.upkeep.rebuild`.
"""

from __future__ import annotations

import itertools
import logging
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from r3store.catalog_types import TrajectoryEntry
from r3store.engine.reader import ShardReader
from r3store.errors import R3StoreError
from r3store.logic import stats
from r3store.policy import ENGINE, SOURCES, Source
from r3store.records import check_source
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.stats import AgreementRecord
from r3store.storage.shard import ShardRow

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class VersionLoad:
    policy_version: int
    tokens: int  # of the segments counted
    load: stats.Counts  # [L, E]


@dataclass(frozen=True)
class VersionAgreement:
    policy_version: int
    segments: int
    tokens: int
    overlap: stats.Overlap


@dataclass(frozen=True)
class VersionDrift:
    before: int
    after: int
    divergence: list[float | None]  # per layer


class Analytics:
    """Statistics of a store's namespaces; `Engine.analytics` is the engine's."""

    def __init__(
        self, catalog: Catalog, reader: ShardReader, spec: Callable[[str], RouteSpec]
    ) -> None:
        self._catalog = catalog
        self._reader = reader
        self._spec = spec

    def loads(
        self, namespace: str, source: Source = ENGINE, newest: int | None = None
    ) -> list[VersionLoad]:
        """Expert load per policy version of the routes of `source` ever stored (of the
        `newest` versions holding them only, when given)."""
        spec = self._spec(namespace)
        shape = (spec.num_layers, spec.num_experts)
        held = self._catalog.stats.expert_loads(namespace, check_source(source), shape, newest)
        return [VersionLoad(v, tokens, counts) for v, (tokens, counts) in sorted(held.items())]

    def drift(
        self, namespace: str, source: Source = ENGINE, newest: int | None = None
    ) -> list[VersionDrift]:
        """Divergence per layer from each policy version to the next one holding routes
        (the last `newest` steps only, when given)."""
        loads = self.loads(namespace, source, None if newest is None else newest + 1)
        return [
            VersionDrift(a.policy_version, b.policy_version, stats.drift(a.load, b.load))
            for a, b in itertools.pairwise(loads)
        ]

    def agreement(
        self, namespace: str, a: Source, b: Source, newest: int | None = None
    ) -> list[VersionAgreement]:
        """Agreement per policy version between the routes of sources `a` and `b` (of
        the `newest` versions measured only, when given)."""
        pair = (check_source(a), check_source(b))
        spec = self._spec(namespace)
        held = self._catalog.stats.agreements(namespace, pair, spec.num_layers, newest)
        return [
            VersionAgreement(v, segments, tokens, overlap)
            for v, (segments, tokens, overlap) in sorted(held.items())
        ]

    def compare_sources(self, namespace: str, spec: RouteSpec, rows: Sequence[ShardRow]) -> None:
        """Measure agreement for segments just stored whose other sources are stored
        too. Never raises: the rows are committed already; a failure is logged and the
        next rebuild measures them."""
        ids = {r.trajectory_id for r in rows if r.source != ENGINE}
        if not ids:
            return
        try:
            self._compare(namespace, spec, self._catalog.segments.lookup(namespace, ids))
        except R3StoreError as exc:
            log.warning(
                "agreement of %d trajectories in %s not measured: %s", len(ids), namespace, exc
            )

    def compare_all(self, namespace: str) -> None:
        """Measure agreement for every stored segment held by more than one source."""
        ids = self._catalog.stats.annotated_ids(namespace)
        spec = self._spec(namespace)
        for begin in range(0, len(ids), 256):
            part = ids[begin : begin + 256]
            self._compare(namespace, spec, self._catalog.segments.lookup(namespace, part))

    def _compare(
        self, namespace: str, spec: RouteSpec, found: dict[str, list[TrajectoryEntry]]
    ) -> None:
        # per pair of sources: the two segments of each (id, start) both hold
        pairs: dict[tuple[Source, Source], list[tuple[TrajectoryEntry, TrajectoryEntry]]]
        pairs = defaultdict(list)
        for segments in found.values():
            by_start: dict[int, dict[Source, TrajectoryEntry]] = defaultdict(dict)
            for e in segments:
                by_start[e.start][e.source] = e
            for held in by_start.values():
                for i, a in enumerate(SOURCES):
                    for b in SOURCES[i + 1 :]:
                        ea, eb = held.get(a), held.get(b)
                        if ea is not None and eb is not None and ea.num_tokens == eb.num_tokens:
                            pairs[(a, b)].append((ea, eb))
        records = []
        for (a, b), both in pairs.items():
            for ea, eb in both:
                read_a = self._reader.read({ea.trajectory_id: [ea]}, spec)[ea.trajectory_id]
                read_b = self._reader.read({eb.trajectory_id: [eb]}, spec)[eb.trajectory_id]
                if read_a.routes is None or read_b.routes is None:
                    continue
                records.append(
                    AgreementRecord(
                        namespace,
                        ea.trajectory_id,
                        ea.start,
                        a,
                        b,
                        ea.policy_version,
                        ea.num_tokens,
                        stats.overlap(read_a.routes, read_b.routes),
                    )
                )
        if records:
            self._catalog.stats.add_agreements(records)
