"""What the catalog holds, as plain values: namespaces, API keys, shards, and where each
trajectory segment lies. No I/O: callers (the server, the client, the CLI) share these
without loading the database layer."""

from __future__ import annotations

from dataclasses import dataclass

from r3store.policy import ENGINE, NamespaceSettings, Source
from r3store.spans import RouteSpans
from r3store.spec import RouteSpec


@dataclass(frozen=True)
class ApiKeyRecord:
    """A key made with `r3store keys create`: only its SHA-256 digest is kept."""

    name: str
    role: str
    namespaces: list[str]
    digest: bytes
    created_at: float
    revoked_at: float | None


@dataclass(frozen=True)
class NamespaceInfo:
    name: str
    spec: RouteSpec
    created_at: float
    policy_version: int
    settings: NamespaceSettings


@dataclass(frozen=True)
class ShardInfo:
    key: str
    namespace: str
    size: int
    num_rows: int
    route_bytes: int
    created_at: float
    retired_at: float | None = None
    rest_level: int | None = None  # the zstd level it was written at by `Maintenance`


@dataclass(frozen=True)
class ShardUsage:
    """How much of a live shard the catalog still points at."""

    key: str
    namespace: str
    size: int
    route_bytes: int  # of all rows as written
    live_rows: int
    live_bytes: int  # route bytes of the rows still pointing here
    created_at: float
    rest_level: int | None = None

    @property
    def live_fraction(self) -> float:
        return self.live_bytes / self.route_bytes if self.route_bytes else 0.0


@dataclass(frozen=True)
class TrajectoryEntry:
    """One segment's catalog row: its metadata and where its routes lie."""

    namespace: str
    trajectory_id: str
    start: int
    group_id: str | None
    policy_version: int
    num_tokens: int
    prompt_len: int
    digest: bytes
    route_bytes: int
    shard_key: str
    row_group: int
    row_index: int
    created_at: float
    spans: RouteSpans
    times_sampled: int = 0
    source: Source = ENGINE
    writer: str | None = None  # the API key that uploaded it; None: unknown (docs/format.md)


@dataclass(frozen=True)
class NamespaceUsage:
    """What a namespace holds: `r3store stats`."""

    trajectories: int
    shards: int
    shard_bytes: int
    live_route_bytes: int
    dead_route_bytes: int
    by_policy_version: dict[int, int]  # trajectories by the version of their first segment
    samplings: int = 0  # trajectories handed out by `sample`, all together
    sampled: int = 0  # trajectories sampled at least once
