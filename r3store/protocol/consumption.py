"""JSON models of leases, step checkpoints and resume (docs/api.md, "Leases and
checkpoints"), shared by the server and the client: the requests, and the answers as
the values themselves (`r3store.leases`), whose fields are their JSON."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from r3store.leases import (
    DEFAULT_LEASE_SECONDS,
    LEASE_ID,
    MAX_LEASE_IDS,
    MAX_LEASE_SECONDS,
    MAX_STEP,
    Checkpoint,
    Lease,
    Resumed,
)
from r3store.logic.sampling import Strategy
from r3store.protocol.fields import ValueModel


class LeaseRequest(BaseModel):
    """Lease `n` trajectories chosen as a sample chooses them, or exactly
    `trajectory_ids`, for `seconds`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    n: int | None = Field(None, ge=1, le=MAX_LEASE_IDS)
    trajectory_ids: list[str] | None = Field(None, min_length=1, max_length=MAX_LEASE_IDS)
    strategy: Strategy = Field(Strategy.FIFO, strict=False)  # enums come as strings
    whole_groups: bool = False
    seed: int | None = Field(None, ge=0, le=2**63 - 1)
    seconds: float = Field(
        DEFAULT_LEASE_SECONDS, gt=0, le=MAX_LEASE_SECONDS, allow_inf_nan=False, strict=False
    )
    epoch: int | None = Field(
        None, ge=0, le=2**63 - 1, description="the trainer's epoch: refused once resumed since"
    )

    @model_validator(mode="after")
    def _one_way(self) -> LeaseRequest:
        if (self.n is None) == (self.trajectory_ids is None):
            raise ValueError("give either n or trajectory_ids")
        return self


class CommitRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    token: str | None = Field(
        None,
        pattern=LEASE_ID.pattern,
        description="32 hex digits the client chose; a retry of this commit sends the same "
        "and is answered as the first was",
    )


class RenewRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    seconds: float = Field(gt=0, le=MAX_LEASE_SECONDS, allow_inf_nan=False, strict=False)


class LeaseModel(ValueModel[Lease]):
    """A lease on the wire: the value itself (`r3store.leases.Lease`), its JSON given
    by its fields, as a read plan's is (`ReadPlanModel`)."""


class LeaseList(BaseModel):
    epoch: int
    leases: list[LeaseModel]


class CheckpointRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    step: int = Field(ge=0, le=MAX_STEP)
    epoch: int | None = Field(None, ge=0, le=2**63 - 1)


class CheckpointModel(ValueModel[Checkpoint]):
    """A checkpoint on the wire: the value itself (`r3store.leases.Checkpoint`)."""


class CheckpointList(BaseModel):
    epoch: int
    checkpoints: list[CheckpointModel]


class CheckpointDeleted(BaseModel):
    namespace: str
    step: int


class ResumedModel(ValueModel[Resumed]):
    """What a resume did, on the wire: the value itself (`r3store.leases.Resumed`)."""
