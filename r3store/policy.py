"""Namespace policies: staleness window, sampling limits, retention and what one key
may hold through leases.

Pure values and rules; the engine applies them, the catalog stores them as JSON. Every
number has a range the catalog can hold (64-bit versions, 32-bit sampling counts), and
JSON of the wrong type (`"4"`, `true`) is refused rather than coerced.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from r3store.leases import MAX_LEASE_SECONDS

MAX_POLICY_VERSION = 2**63 - 1
MAX_TIMES_SAMPLED = 2**31 - 1
MAX_TTL_SECONDS = 1e10  # about 317 years

# a limit on a count (checkpoints kept, leases open, trajectories held, samplings): at
# least 1, and no more than the catalog's 32-bit counts hold
CountLimit = Annotated[int, Field(ge=1, le=MAX_TIMES_SAMPLED)]

# Where a segment's routes come from: `engine`, observed at rollout (the trajectory
# itself); `predicted`, a predictor's top-k for the same tokens, which replay takes
# instead of the observed ones (PR2); `trainer`, what the trainer's own routers chose.
Source = Literal["engine", "predicted", "trainer"]
SOURCES: tuple[Source, ...] = ("engine", "predicted", "trainer")
ENGINE: Source = "engine"
DEFAULT_READ_SOURCES: tuple[Source, ...] = ("predicted", "engine")


class Retention(BaseModel):
    """What a namespace keeps. Validated and stored here; enforced by the retention
    machinery (operations). `Retention(keep_versions=4, ttl_seconds=86400)`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    keep_versions: int | None = Field(
        None, ge=1, le=MAX_POLICY_VERSION, description="keep the last N policy versions"
    )
    ttl_seconds: float | None = Field(
        None,
        gt=0,
        le=MAX_TTL_SECONDS,
        allow_inf_nan=False,
        description="drop trajectories first stored longer ago than this",
    )
    evict_after_sampled: bool = Field(
        False, description="drop a trajectory once it was sampled max_times_sampled times"
    )
    keep_checkpoints: CountLimit | None = Field(
        3,
        description="keep the newest N step checkpoints (routes consumed after the oldest "
        "kept one are kept for a resume); None: keep every checkpoint",
    )


class Leasing(BaseModel):
    """What one API key may hold of a namespace through leases at once, so that no
    key (a dashboard's, say) keeps the trajectories from the trainer's.
    `Leasing(max_open=4, max_held=8192, max_seconds=3600)`."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_open: CountLimit | None = Field(
        1024, description="open leases one key holds at once; None: no limit"
    )
    max_held: CountLimit | None = Field(
        None, description="trajectories one key's open leases hold at once; None: no limit"
    )
    max_seconds: float = Field(
        86400.0,
        gt=0,
        le=MAX_LEASE_SECONDS,
        allow_inf_nan=False,
        description="the longest a lease is taken or renewed for",
    )


class NamespaceSettings(BaseModel):
    """A namespace's policies. `max_policy_lag=2` accepts and serves routes of the
    current policy version and the two before it."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_policy_lag: int | None = Field(
        None,
        ge=0,
        le=MAX_POLICY_VERSION,
        description="routes older than current - lag are stale; None: no limit",
    )
    max_times_sampled: CountLimit | None = Field(
        None, description="a trajectory is sampled at most this often; None: no limit"
    )
    retention: Retention = Field(default_factory=Retention)
    leasing: Leasing = Field(default_factory=Leasing)
    read_sources: list[Source] = Field(
        default_factory=lambda: list(DEFAULT_READ_SOURCES),
        min_length=1,
        max_length=len(SOURCES),
        description="the route source a read serves by default: the first of these that "
        "a trajectory holds for all its tokens",
    )

    @field_validator("read_sources")
    @classmethod
    def _distinct(cls, value: list[Source]) -> list[Source]:
        if len(set(value)) != len(value):
            raise ValueError("read_sources names a source twice")
        return value


def staleness_floor(current_version: int, settings: NamespaceSettings) -> int | None:
    """The oldest policy version still inside the window, or None when all are."""
    if settings.max_policy_lag is None:
        return None
    return current_version - settings.max_policy_lag


def is_stale(policy_version: int, current_version: int, settings: NamespaceSettings) -> bool:
    floor = staleness_floor(current_version, settings)
    return floor is not None and policy_version < floor


def newest_accepted(current_version: int, max_ahead: int | None) -> int | None:
    """The newest policy version an upload may hold: `max_ahead` versions past the
    current one (None: any). Bounding it keeps a writer from filling a namespace with
    versions its trainer never reached (each one a statistics row for every commit)."""
    if max_ahead is None:
        return None
    return min(current_version + max_ahead, MAX_POLICY_VERSION)
