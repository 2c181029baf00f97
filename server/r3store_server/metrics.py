"""Prometheus metrics, one registry per app."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from r3store.engine import Engine
from r3store.maintenance import Maintenance


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
            "r3store_trajectories_dropped",
            "trajectories dropped by retention",
            totals.trajectories_dropped,
        )
