"""JSON models of the HTTP control plane, shared by the server and the client.

Bulk route data never travels in these: see `r3store.wire` for the binary formats.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from r3store.catalog_types import NamespaceInfo
from r3store.policy import MAX_POLICY_VERSION, NamespaceSettings
from r3store.sampling import Strategy
from r3store.spec import MAX_EXPERTS, MAX_LAYERS, MAX_TOP_K, RouteSpec
from r3store.wire import ReadFormat

NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"


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


class PutItem(BaseModel):
    trajectory_id: str
    start: int
    created: bool = Field(description="false: already stored with the same content")


class PutResponse(BaseModel):
    results: list[PutItem]


# BatchRequest: a trainer rank asks for the routes of the trajectories it holds
class BatchRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    ids: list[str] = Field(min_length=1, max_length=10_000)
    format: ReadFormat = Field(ReadFormat.ENCODED, strict=False)  # enums come as strings
    include_stale: bool = False


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


__all__ = [
    "BatchRequest",
    "ErrorBody",
    "ErrorDetail",
    "Health",
    "NamespaceCreate",
    "NamespaceDeleted",
    "NamespaceList",
    "NamespacePublic",
    "PolicyVersionSet",
    "PutItem",
    "PutResponse",
    "RouteSpecModel",
    "SampleRequest",
]
