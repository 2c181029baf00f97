"""Route statistics: expert load per policy version, agreement between route sources,
drift between versions, and the expert load of chosen trajectories (to balance
micro-batches across expert-parallel ranks before running them). Reader or admin."""

from __future__ import annotations

from fastapi import APIRouter, Query

from r3store.logic import stats
from r3store.policy import ENGINE, MAX_POLICY_VERSION, Source
from r3store.protocol.models import (
    AgreementModel,
    DriftModel,
    DriftStepModel,
    ExpertLoadModel,
    TrajectoryLoadModel,
    TrajectoryLoadRequest,
    TrajectoryLoadsModel,
    VersionAgreementModel,
    VersionLoadModel,
)
from r3store.protocol.wire import ReadFormat
from r3store_server.api_routes import read_limit
from r3store_server.deps import NamespaceDep, SettingsDep, allowed
from r3store_server.errors import ERROR_RESPONSES

router = APIRouter(
    prefix="/v1/namespaces",
    tags=["statistics"],
    responses=ERROR_RESPONSES,
    dependencies=[allowed("read")],
)
SourceQuery = Query(ENGINE, description="route source: engine, predicted or trainer")
# one Query object per parameter: FastAPI keys a shared one by the first name it was
# given, so a second parameter made with it would read (and bound) the first's value
MinVersion = Query(None, ge=0, le=MAX_POLICY_VERSION, description="the oldest version shown")
MaxVersion = Query(None, ge=0, le=MAX_POLICY_VERSION, description="the newest version shown")
SourceA = Query(ENGINE, description="one route source")
SourceB = Query("trainer", description="the other route source")


def in_range(version: int, low: int | None, high: int | None) -> bool:
    return (low is None or version >= low) and (high is None or version <= high)


@router.get("/{namespace}/stats/experts")
async def expert_load(
    at: NamespaceDep,
    source: Source = SourceQuery,
    min_version: int | None = MinVersion,
    max_version: int | None = MaxVersion,
) -> ExpertLoadModel:
    """Expert load per policy version: for each layer and expert, the token-layers of
    the routes ever stored (counted at ingest; retention does not take them back)."""

    def answer(namespace: str) -> ExpertLoadModel:
        loads = at.engine.analytics.loads(namespace, source)
        return ExpertLoadModel(
            source=source,
            versions=[
                VersionLoadModel(
                    policy_version=v.policy_version,
                    tokens=v.tokens,
                    load=v.load.tolist(),
                    imbalance=stats.imbalance(v.load),
                )
                for v in loads
                if in_range(v.policy_version, min_version, max_version)
            ],
        )

    return await at.run(answer, what="the expert load")


@router.get("/{namespace}/stats/agreement")
async def agreement(at: NamespaceDep, a: Source = SourceA, b: Source = SourceB) -> AgreementModel:
    """How far two route sources of the same trajectories agree, per policy version and
    layer: the experts both chose over the experts the smaller choice holds."""

    def answer(namespace: str) -> AgreementModel:
        held = at.engine.analytics.agreement(namespace, a, b)
        return AgreementModel(
            sources=(a, b),
            versions=[
                VersionAgreementModel(
                    policy_version=v.policy_version,
                    segments=v.segments,
                    tokens=v.tokens,
                    agreement=v.overlap.fraction,
                    overall=v.overlap.overall,
                )
                for v in held
            ],
        )

    return await at.run(answer, what="the agreement")


@router.get("/{namespace}/stats/drift")
async def drift(at: NamespaceDep, source: Source = SourceQuery) -> DriftModel:
    """Router drift: per layer, the Jensen-Shannon divergence (base 2, 0 to 1) of the
    expert load of each policy version from the one before it."""

    def answer(namespace: str) -> DriftModel:
        steps = at.engine.analytics.drift(namespace, source)
        return DriftModel(
            source=source,
            steps=[
                DriftStepModel(before=d.before, after=d.after, divergence=d.divergence)
                for d in steps
            ],
        )

    return await at.run(answer, what="the drift")


@router.post("/{namespace}/stats/experts/trajectories")
async def trajectory_loads(
    body: TrajectoryLoadRequest, at: NamespaceDep, settings: SettingsDep
) -> TrajectoryLoadsModel:
    """Per-expert token counts of the routes a read of `ids` would serve (same source
    and staleness rules), so a trainer can spread micro-batches over expert-parallel
    ranks before running them. The routes are decoded here: at most
    `R3STORE_MAX_READ_BYTES` of them, as a read in format `ids` would hold (413)."""

    def answer(namespace: str) -> TrajectoryLoadsModel:
        spec = at.engine.namespaces.spec(namespace)
        limit = read_limit(spec, ReadFormat.IDS, settings.max_read_bytes, len(body.ids))
        batch = at.engine.get_batch(
            namespace,
            body.ids,
            include_stale=body.include_stale,
            source=body.source,
            admit=limit,
        )
        return TrajectoryLoadsModel(
            ids=batch.ids,
            missing=batch.missing,
            stale=batch.stale,
            trajectories=[
                TrajectoryLoadModel(
                    trajectory_id=item.trajectory_id,
                    source=item.source,
                    num_tokens=item.num_tokens,
                    load=stats.expert_load(item.routes, spec).tolist(),
                )
                for item in {i.trajectory_id: i for i in batch.found}.values()
                if item.routes is not None
            ],
        )

    return await at.run(answer, what="the trajectories' expert load")
