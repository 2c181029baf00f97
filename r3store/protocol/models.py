"""JSON models of the HTTP control plane, shared by the server and the client.

Bulk route data never travels in these: see `r3store.protocol.wire` for the binary formats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from r3store.catalog_types import NamespaceInfo
from r3store.errors import InvalidInput
from r3store.logic.sampling import Strategy
from r3store.logic.spans import ByteRange, RouteSpans, Span
from r3store.policy import ENGINE, MAX_POLICY_VERSION, NamespaceSettings, Source
from r3store.protocol.plans import PlannedDictionary, PlannedObject, PlannedSegment, ReadPlan
from r3store.protocol.wire import ReadFormat
from r3store.records import PutResult
from r3store.spec import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K, RouteSpec

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
_SOURCE_DOC = (
    "serve routes of this source only (ids without them for all their tokens are missing); "
    "default: the first of the namespace's read_sources each trajectory holds"
)


class RouteSpecModel(BaseModel):
    """The route spec, fixed when a namespace is made."""

    model_config = ConfigDict(extra="forbid", strict=True)

    num_layers: int = Field(ge=1, le=MAX_LAYERS, description="MoE layers L")
    num_experts: int = Field(ge=1, le=MAX_EXPERTS, description="experts per layer E")
    top_k: int = Field(ge=1, le=MAX_TOP_K, description="experts chosen per token K")
    ordered: bool = Field(False, description="keep the top-k order the engine emitted")
    allow_fewer: bool = Field(False, description="accept token-layers with fewer than K")
    model: str = Field("", max_length=200, description="model name, for people")

    def to_spec(self) -> RouteSpec:
        return RouteSpec(**self.model_dump())

    @classmethod
    def of(cls, spec: RouteSpec) -> RouteSpecModel:
        return cls(**spec.__dict__)


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


class SpanModel(BaseModel):
    offset: int = Field(ge=0)
    length: int = Field(ge=0)

    def to_span(self) -> Span:
        return Span(self.offset, self.length)


class PlannedObjectModel(BaseModel):
    key: str
    url: str = Field(description="a presigned GET; send `Range: bytes=start-(end-1)`")
    ranges: list[tuple[int, int]] = Field(description="[start, end) byte ranges to fetch")


class PlannedSegmentModel(BaseModel):
    trajectory_id: str
    group_id: str | None
    prompt_len: int
    start: int
    num_tokens: int
    policy_version: int
    digest: str = Field(description="hex")
    object: int = Field(ge=0, description="index into objects")
    route_transform: int
    route_ids: SpanModel
    route_counts: SpanModel | None
    route_order: SpanModel | None
    token_ids: SpanModel | None
    source: Source = ENGINE
    route_dictionary: str | None = Field(
        None, description="hex digest of the dictionary the ids streams need (dictionaries)"
    )
    prefix: PlannedPrefixModel | None = Field(
        None, description="the streams of the first `tokens` tokens, shared with other rows"
    )


class PlannedPrefixModel(BaseModel):
    tokens: int = Field(gt=0)
    route_transform: int
    route_ids: SpanModel
    route_counts: SpanModel | None
    route_order: SpanModel | None


class PlannedDictionaryModel(BaseModel):
    digest: str = Field(description="hex, SHA-256[:16] of the dictionary's bytes")
    url: str = Field(description="a presigned GET of the whole dictionary")


class ReadPlanModel(BaseModel):
    """Where a batch's route streams lie (docs/api.md, "Direct reads")."""

    spec: RouteSpecModel
    ids: list[str]
    missing: list[str]
    stale: list[str]
    expires_at: float = Field(description="seconds since the epoch")
    objects: list[PlannedObjectModel]
    segments: list[PlannedSegmentModel]
    dictionaries: list[PlannedDictionaryModel] = []

    @classmethod
    def of(cls, plan: ReadPlan) -> ReadPlanModel:
        return cls(
            spec=RouteSpecModel.of(plan.spec),
            ids=plan.ids,
            missing=plan.missing,
            stale=plan.stale,
            expires_at=plan.expires_at,
            objects=[
                PlannedObjectModel(
                    key=o.key, url=o.url, ranges=[(r.start, r.end) for r in o.ranges]
                )
                for o in plan.objects
            ],
            segments=[
                PlannedSegmentModel.model_validate(
                    {
                        "trajectory_id": g.trajectory_id,
                        "group_id": g.group_id,
                        "prompt_len": g.prompt_len,
                        "start": g.start,
                        "num_tokens": g.num_tokens,
                        "policy_version": g.policy_version,
                        "digest": g.digest.hex(),
                        "object": g.obj,
                        "source": g.source,
                        **g.spans.to_json(),
                    }
                )
                for g in plan.segments
            ],
            dictionaries=[
                PlannedDictionaryModel(digest=d.digest.hex(), url=d.url) for d in plan.dictionaries
            ],
        )

    def to_plan(self) -> ReadPlan:
        def spans_of(g: PlannedSegmentModel) -> RouteSpans:
            try:
                return RouteSpans.from_json(g.model_dump())
            except ValueError:
                text = g.route_dictionary or ""
                raise InvalidInput(f"not a hex digest: {text[:40]!r}") from None

        objects = [
            PlannedObject(o.key, o.url, [ByteRange(a, b) for a, b in o.ranges])
            for o in self.objects
        ]
        for g in self.segments:
            if g.object >= len(objects):
                raise InvalidInput(f"the plan names object {g.object} of {len(objects)}")
        segments = [
            PlannedSegment(
                g.trajectory_id,
                g.group_id,
                g.prompt_len,
                g.start,
                g.num_tokens,
                g.policy_version,
                bytes.fromhex(g.digest),
                g.object,
                spans_of(g),
                g.source,
            )
            for g in self.segments
        ]
        return ReadPlan(
            self.spec.to_spec(),
            self.ids,
            self.missing,
            self.stale,
            self.expires_at,
            objects,
            segments,
            [PlannedDictionary(bytes.fromhex(d.digest), d.url) for d in self.dictionaries],
        )


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
    "PlannedObjectModel",
    "PlannedSegmentModel",
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
