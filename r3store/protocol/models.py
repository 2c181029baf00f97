"""JSON models of the HTTP control plane, shared by the server and the client.

Bulk route data never travels in these: see `r3store.protocol.wire` for the binary formats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from r3store.catalog_types import NamespaceInfo
from r3store.errors import InvalidInput
from r3store.logic.sampling import Strategy
from r3store.policy import ENGINE, MAX_POLICY_VERSION, NamespaceSettings, Source
from r3store.protocol.fields import RouteSpecModel, SpanModel, ValueModel
from r3store.protocol.plans import ReadPlan
from r3store.protocol.wire import ReadFormat
from r3store.records import PutResult
from r3store.spec import MAX_LAYERS

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SOURCE_DOC = (
    "serve routes of this source only (ids without them for all their tokens are missing); "
    "default: the first of the namespace's read_sources each trajectory holds"
)


# NamespaceCreate: what an admin sends to make a namespace
class NamespaceCreate(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(pattern=NAME_PATTERN, description="one RL run")
    spec: RouteSpecModel
    settings: NamespaceSettings = Field(default_factory=NamespaceSettings)


# NamespacePublic: what the server says of a namespace
class NamespacePublic(BaseModel):
    name: str
    spec: RouteSpecModel
    settings: NamespaceSettings
    policy_version: int
    created_at: float
    trajectories: int | None = None

    @classmethod
    def of(cls, info: NamespaceInfo, trajectories: int | None = None) -> NamespacePublic:
        return cls(
            name=info.name,
            spec=RouteSpecModel.of(info.spec),
            settings=info.settings,
            policy_version=info.policy_version,
            created_at=info.created_at,
            trajectories=trajectories,
        )


class NamespaceList(BaseModel):
    namespaces: list[NamespacePublic]


class NamespaceDeleted(BaseModel):
    name: str
    objects_deleted: int


# PolicyVersionSet: what a trainer sends when its weights change
class PolicyVersionSet(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    policy_version: int = Field(ge=0, le=MAX_POLICY_VERSION)
    force: bool = Field(
        False,
        description="set it as given, back or any distance forward (an admin's repair); "
        "without: forward only, at most the server's R3STORE_MAX_POLICY_STEP",
    )


class PutItem(BaseModel):
    trajectory_id: str
    start: int
    created: bool = Field(description="false: already stored with the same content")
    source: Source = ENGINE
    num_tokens: int = Field(0, description="the segment's tokens")
    policy_version: int = Field(0, description="the segment's policy version (as stored)")
    digest: str = Field(
        "", description="the segment's content digest, 32 hex digits: what a route ref names"
    )

    @classmethod
    def of(cls, result: PutResult) -> PutItem:
        return cls(
            trajectory_id=result.trajectory_id,
            start=result.start,
            created=result.created,
            source=result.source,
            num_tokens=result.num_tokens,
            policy_version=result.policy_version,
            digest=result.digest.hex(),
        )

    def result(self) -> PutResult:
        return PutResult(
            self.trajectory_id,
            self.created,
            self.start,
            self.source,
            self.num_tokens,
            self.policy_version,
            bytes.fromhex(self.digest),
        )


class PutResponse(BaseModel):
    results: list[PutItem]


# BatchRequest: a trainer rank asks for the routes of the trajectories it holds
class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(min_length=1, max_length=10_000)
    format: ReadFormat = Field(ReadFormat.ENCODED, strict=False)  # enums come as strings
    include_stale: bool = False
    source: Source | None = Field(None, description=_SOURCE_DOC)
    layers: list[int] | None = Field(
        None,
        min_length=1,
        max_length=MAX_LAYERS,
        description="only these layers (distinct increasing indices into the spec's "
        "layers: a pipeline stage's MoE layers); the answer's spec has as many",
    )


# SampleRequest: take trajectories from the buffer
class SampleRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    n: int = Field(ge=1, le=10_000)
    strategy: Strategy = Field(Strategy.FIFO, strict=False)
    whole_groups: bool = False
    format: ReadFormat = Field(ReadFormat.ENCODED, strict=False)  # enums come as strings
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


class ErrorDetail(BaseModel):
    code: str = Field(description="machine-readable: invalid_routes, not_found, conflict, ...")
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class Health(BaseModel):
    status: Literal["ok", "ready", "unavailable"]
    detail: str | None = None


# PlanRequest / ReadPlanModel: a direct read (the client fetches from the object store)
class PlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(min_length=1, max_length=10_000)
    include_stale: bool = False
    expires: int = Field(60, ge=1, le=3600, description="seconds the URLs stay valid")
    source: Source | None = Field(None, description=_SOURCE_DOC)


class ReadPlanModel(ValueModel[ReadPlan]):
    """Where a batch's route streams lie (docs/api.md, "Direct reads"): the plan itself,
    its JSON given by its fields (`plans.py`)."""

    def to_plan(self) -> ReadPlan:
        plan = self.root
        for g in plan.segments:
            if g.obj >= len(plan.objects):
                raise InvalidInput(f"the plan names object {g.obj} of {len(plan.objects)}")
        return plan


# statistics (r3store.engine.analytics)
class VersionLoadModel(BaseModel):
    policy_version: int
    tokens: int = Field(description="tokens of the segments counted")
    load: list[list[int]] = Field(description="[layer][expert] token-layers that chose it")
    imbalance: list[float | None] = Field(description="per layer: busiest expert / mean")


class ExpertLoadModel(BaseModel):
    source: Source
    versions: list[VersionLoadModel]


class VersionAgreementModel(BaseModel):
    policy_version: int
    segments: int
    tokens: int
    agreement: list[float | None] = Field(
        description="per layer: sum |A & B| / sum min(|A|, |B|) over token-layers both hold"
    )
    overall: float | None


class AgreementModel(BaseModel):
    sources: tuple[Source, Source]
    versions: list[VersionAgreementModel]


class DriftStepModel(BaseModel):
    before: int = Field(description="policy version")
    after: int = Field(description="the next policy version holding routes")
    divergence: list[float | None] = Field(description="per layer: Jensen-Shannon, base 2")


class DriftModel(BaseModel):
    source: Source
    steps: list[DriftStepModel]


class TrajectoryLoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(min_length=1, max_length=10_000)
    include_stale: bool = False
    source: Source | None = Field(None, description=_SOURCE_DOC)


class TrajectoryLoadModel(BaseModel):
    trajectory_id: str
    source: Source
    num_tokens: int
    load: list[list[int]] = Field(description="[layer][expert] token-layers that chose it")


class TrajectoryLoadsModel(BaseModel):
    ids: list[str]
    missing: list[str]
    stale: list[str]
    trajectories: list[TrajectoryLoadModel] = Field(description="found ids, in the order asked")


__all__ = [
    "AgreementModel",
    "BatchRequest",
    "DriftModel",
    "DriftStepModel",
    "ExpertLoadModel",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "NamespaceCreate",
    "NamespaceDeleted",
    "NamespaceList",
    "NamespacePublic",
    "PlanRequest",
    "PolicyVersionSet",
    "PutItem",
    "PutResponse",
    "ReadPlanModel",
    "RouteSpecModel",
    "SpanModel",
    "SampleRequest",
    "TrajectoryLoadModel",
    "TrajectoryLoadRequest",
    "TrajectoryLoadsModel",
    "VersionAgreementModel",
    "VersionLoadModel",
]
