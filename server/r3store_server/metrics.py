"""Prometheus metrics, one registry per app."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from r3store.catalog_types import NamespaceInfo
from r3store.engine import Engine
from r3store.engine.maintenance import Maintenance
from r3store.errors import NotFound, R3StoreError
from r3store.logic import stats
from r3store.policy import SOURCES
from r3store_server.limits import MemoryBudget

log = logging.getLogger(__name__)


class _EngineCollector(Collector):
    def __init__(self, engine: Engine) -> None:
        self._engine = engine

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self._engine.writer_stats
        config = self._engine.config.writer
        yield GaugeMetricFamily(
            "r3store_write_buffer_bytes", "encoded bytes waiting for commit", stats.pending_bytes
        )
        yield GaugeMetricFamily(
            "r3store_write_buffer_fill",
            "write buffer fill, 0..1",
            stats.pending_bytes / config.buffer_bytes,
        )
        yield CounterMetricFamily("r3store_shards_written", "shards stored", stats.shards_written)
        yield CounterMetricFamily("r3store_segments_written", "segments stored", stats.rows_written)
        yield CounterMetricFamily(
            "r3store_shard_bytes_written", "bytes of shards stored", stats.bytes_written
        )


class _BudgetCollector(Collector):
    def __init__(self, budget: MemoryBudget) -> None:
        self._budget = budget

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "r3store_memory_held_bytes",
            "bytes the memory budget holds: bodies, decoding and answers in flight",
            self._budget.used,
        )
        yield GaugeMetricFamily(
            "r3store_memory_limit_bytes", "the memory budget", self._budget.limit
        )


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "r3store_http_requests",
            "requests",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "r3store_http_request_seconds", "request latency", ["route"], registry=self.registry
        )
        self.errors = Counter("r3store_errors", "errors by code", ["code"], registry=self.registry)
        self.bytes_in = Counter("r3store_bytes_in", "request body bytes", registry=self.registry)
        self.bytes_out = Counter("r3store_bytes_out", "route bytes sent", registry=self.registry)
        self.token_layers_in = Counter(
            "r3store_token_layers_in", "token-layers accepted", registry=self.registry
        )
        self.token_layers_out = Counter(
            "r3store_token_layers_out", "token-layers served", registry=self.registry
        )
        self.commit = Histogram(
            "r3store_put_seconds",
            "time from upload parsed to durable commit",
            registry=self.registry,
            buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
        )

    def watch(self, engine: Engine) -> None:
        self.registry.register(_EngineCollector(engine))

    def watch_budget(self, budget: MemoryBudget) -> None:
        self.registry.register(_BudgetCollector(budget))

    def watch_namespaces(self, engine: Engine, interval: float = 15.0) -> None:
        """Per-namespace gauges, gathered every `interval` seconds off the event loop."""
        self.namespaces = _NamespaceCollector(engine, interval)
        self.registry.register(self.namespaces)

    def close(self) -> None:
        """Stop gathering (before the engine closes)."""
        collector: _NamespaceCollector | None = getattr(self, "namespaces", None)
        if collector is not None:
            collector.close()

    def watch_maintenance(self, maintenance: Maintenance) -> None:
        self.registry.register(_MaintenanceCollector(maintenance))


class _MaintenanceCollector(Collector):
    def __init__(self, maintenance: Maintenance) -> None:
        self._maintenance = maintenance

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        totals = self._maintenance.totals
        yield GaugeMetricFamily(
            "r3store_live_route_bytes", "route bytes the catalog points at", totals.live_bytes
        )
        yield GaugeMetricFamily(
            "r3store_dead_route_bytes",
            "route bytes in shards no longer pointed at",
            totals.dead_bytes,
        )
        yield CounterMetricFamily(
            "r3store_objects_deleted",
            "shard objects deleted",
            totals.objects_deleted + totals.orphans_deleted,
        )
        yield CounterMetricFamily(
            "r3store_compactions", "shards compacted", totals.shards_compacted
        )
        yield CounterMetricFamily(
            "r3store_maintenance_passes", "maintenance passes run", self._maintenance.passes
        )
        yield CounterMetricFamily(
            "r3store_trajectories_dropped",
            "trajectories dropped by retention",
            totals.trajectories_dropped,
        )


class _NamespaceCollector(Collector):
    """Per namespace, read from the catalog: trajectories and policy version; of the
    newest policy version holding routes, per layer, the expert-load imbalance (busiest
    over mean), the agreement between route sources and the drift from the version
    before. Per-expert counts stay out (layers x experts series): `GET .../stats/experts`
    has them.

    A scrape never reads the catalog: a background thread gathers the gauges every
    `interval` seconds and a scrape serves the last gathering. Each gathering is bounded
    however many policy versions a namespace holds: it reads the newest version's load
    and agreement, and the version before it for drift (`newest=`), nothing older."""

    def __init__(self, engine: Engine, interval: float) -> None:
        self._engine = engine
        self._interval = interval
        self._families = self._empty()
        self.gathered = 0  # gatherings done
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="r3store-metrics", daemon=True)
        self._thread.start()

    def collect(self) -> Iterator[GaugeMetricFamily]:
        yield from self._families

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.refresh()
            self._stop.wait(self._interval)

    def refresh(self) -> None:
        """Gather every namespace's gauges now; scrapes serve them from then on."""
        families = self._empty()
        try:
            self._gather(families)
        except R3StoreError as exc:  # the catalog is down: the other metrics still answer
            log.warning("namespace metrics not gathered: %s", exc)
            families = self._empty()
        except Exception:  # never let the thread die: the next gathering may succeed
            log.exception("namespace metrics not gathered")
            families = self._empty()
        self._families = families
        self.gathered += 1

    @staticmethod
    def _empty() -> _Gauges:
        return _Gauges(
            GaugeMetricFamily(
                "r3store_namespace_trajectories", "trajectories stored", labels=["namespace"]
            ),
            GaugeMetricFamily(
                "r3store_namespace_policy_version", "current policy version", labels=["namespace"]
            ),
            GaugeMetricFamily(
                "r3store_expert_load_imbalance",
                "newest policy version: busiest expert's load over the mean, per layer",
                labels=["namespace", "source", "layer"],
            ),
            GaugeMetricFamily(
                "r3store_route_agreement",
                "newest policy version measured: agreement between two route sources, per layer",
                labels=["namespace", "sources", "layer"],
            ),
            GaugeMetricFamily(
                "r3store_router_drift",
                "Jensen-Shannon divergence of engine expert load from the previous version",
                labels=["namespace", "layer"],
            ),
        )

    def _gather(self, gauges: _Gauges) -> None:
        for info in self._engine.namespaces.all():
            try:
                self._namespace(info, gauges)
            except NotFound:  # deleted since it was listed
                continue

    def _namespace(self, info: NamespaceInfo, gauges: _Gauges) -> None:
        analytics = self._engine.analytics
        ns = info.name
        gauges.trajectories.add_metric([ns], self._engine.namespaces.count(ns))
        gauges.version.add_metric([ns], info.policy_version)
        for source in SOURCES:
            loads = analytics.loads(ns, source, newest=1)
            if loads:
                _per_layer(gauges.imbalance, [ns, source], stats.imbalance(loads[-1].load))
        for i, a in enumerate(SOURCES):
            for b in SOURCES[i + 1 :]:
                held = analytics.agreement(ns, a, b, newest=1)
                if held:
                    _per_layer(gauges.agreement, [ns, f"{a}/{b}"], held[-1].overlap.fraction)
        steps = analytics.drift(ns, newest=1)
        if steps:
            _per_layer(gauges.drift, [ns], steps[-1].divergence)


class _Gauges(NamedTuple):
    """The per-namespace gauge families of one gathering, in the order scrapes list them."""

    trajectories: GaugeMetricFamily
    version: GaugeMetricFamily
    imbalance: GaugeMetricFamily
    agreement: GaugeMetricFamily
    drift: GaugeMetricFamily


def _per_layer(
    family: GaugeMetricFamily, labels: list[str], values: Sequence[float | None]
) -> None:
    """A gauge per layer that has a value, labelled `labels` and the layer."""
    for layer, value in enumerate(values):
        if value is not None:
            family.add_metric([*labels, str(layer)], value)
