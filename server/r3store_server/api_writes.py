"""Direct writes (docs/api.md, "Direct writes"): a rollout worker asks for a write plan,
then for the plan's URL for its blob's size, uploads its encoded streams to the object
store with it, and commits them here; the server checks what was uploaded before it
acknowledges. A writer's or an admin's; only the API key that asked for a plan may ask
for its URL and commit it."""

from __future__ import annotations

import time

from fastapi import APIRouter

from r3store.engine.direct import WritePlan
from r3store.errors import PayloadTooLarge, StoreError
from r3store.logic.streams import checking_bytes
from r3store.protocol.direct import (
    PLAN_SECONDS,
    BlobUploadModel,
    PlanDictionary,
    UploadRequest,
    WriteCommit,
    WriteCommitted,
    WritePlanModel,
    WritePlanRequest,
)
from r3store.protocol.models import PutItem
from r3store_server.api_routes import charge_rows
from r3store_server.deps import (
    BudgetDep,
    MetricsDep,
    NamespaceDep,
    PrincipalDep,
    SettingsDep,
    allowed,
)
from r3store_server.errors import ERROR_RESPONSES
from r3store_server.limits import MemoryBudget
from r3store_server.settings import UPLOAD_COST

router = APIRouter(prefix="/v1/namespaces", tags=["routes"], responses=ERROR_RESPONSES)


@router.post(
    "/{namespace}/writes",
    status_code=201,
    response_model=WritePlanModel,
    dependencies=[allowed("write")],
)
async def plan_write(
    body: WritePlanRequest,
    at: NamespaceDep,
    settings: SettingsDep,
    who: PrincipalDep,
    budget: BudgetDep,
) -> WritePlanModel:
    """A plan for one blob: the token to ask for its URL and to commit it with (this
    API key only), working for `expires` seconds. 400
    `direct_unavailable` where the object store signs no URLs (the embedded store):
    upload through `POST .../trajectories` instead. 429 when the key holds
    `R3STORE_MAX_PLANS_PER_KEY` plans not committed and not expired."""
    most = settings.max_plans_per_key
    plan = await at.run(at.engine.direct.plan, who.name, body.expires, most)
    return _model(plan, budget)


def admissible(budget: MemoryBudget) -> int:
    """The largest blob a commit can ever hold in the upload memory budget."""
    return min(budget.limit, budget.per_key) // UPLOAD_COST


def _model(plan: WritePlan, budget: MemoryBudget) -> WritePlanModel:
    dictionary = None
    if plan.dictionary is not None:
        digest, url = plan.dictionary
        dictionary = PlanDictionary(digest=digest.hex(), url=url)
    return WritePlanModel(
        plan=plan.plan,
        expires_at=plan.expires_at,
        max_bytes=min(plan.max_bytes, admissible(budget)),
        dictionary=dictionary,
    )


@router.post(
    "/{namespace}/writes/upload",
    response_model=BlobUploadModel,
    responses={413: ERROR_RESPONSES[400]},
    dependencies=[allowed("write")],
)
async def upload_url(
    body: UploadRequest, at: NamespaceDep, who: PrincipalDep, budget: BudgetDep
) -> BlobUploadModel:
    """The presigned, create-only PUT of the blob `plan` names, for exactly `size`
    bytes (the object store refuses another length, 403), working until the plan
    expires: ask once the blob is encoded. 413 past the plan's `max_bytes`; 409
    `plan_gone` once the plan expired (ask for a new one); 403 from another API key."""
    most = admissible(budget)
    made = await at.run(at.engine.direct.upload, body.plan, body.size, who.name, most)
    return BlobUploadModel(url=made.url, headers=made.headers, expires_at=made.expires_at)


@router.post(
    "/{namespace}/writes/commit",
    response_model=WriteCommitted,
    responses={413: ERROR_RESPONSES[400], 429: ERROR_RESPONSES[400]},
    dependencies=[allowed("write")],
)
async def commit_write(
    body: WriteCommit,
    at: NamespaceDep,
    settings: SettingsDep,
    metrics: MetricsDep,
    budget: BudgetDep,
    who: PrincipalDep,
) -> WriteCommitted:
    """Check the blob uploaded with `plan` and commit the segments it holds; answers as
    an upload does, after the durable commit. Every segment's streams are checked
    (as an upload's encoded routes) before anything is acknowledged: all are stored, or
    none. Sent again, the same commit answers the same results (`created: false`).
    403 from another API key than the plan's; 400 when nothing (or another size) was
    uploaded; 429 when uploads in flight hold the memory budget. With `next_plans`, the
    answer carries that many plans for the next blobs (`next`), made in one catalog
    transaction."""
    spec = await at.run(at.engine.namespaces.spec)
    # the plan's own before any memory is held: a forged or foreign one holds none
    await at.run(at.engine.direct.check_plan, body.plan, who.name)
    most = admissible(budget)
    if body.size > most:
        raise PayloadTooLarge(
            f"a blob of {body.size} bytes; one commit may hold at most {most} while it is "
            "checked (R3STORE_UPLOAD_MEMORY_BYTES, R3STORE_UPLOAD_MEMORY_PER_KEY): write "
            "fewer segments a blob"
        )
    reservation = await budget.admit(
        UPLOAD_COST * body.size, settings.request_timeout / 2, who.name
    )
    checking = checking_bytes(spec, max((s.num_tokens for s in body.segments), default=0))
    try:
        charge_rows(len(body.segments), spec, budget, reservation, checking)
    except BaseException:
        reservation.release()
        raise

    def store(namespace: str) -> WriteCommitted:
        if at.deadline.cancelled.is_set():
            raise StoreError("the commit was answered before it was checked")
        started = time.perf_counter()
        results = at.engine.direct.commit(
            namespace,
            body.plan,
            body.size,
            body.segments,
            writer=who.name,
            annotate_any=who.may("annotate", namespace),
        )
        metrics.commit.observe(time.perf_counter() - started)
        metrics.token_layers_in.inc(sum(s.num_tokens for s in body.segments) * spec.num_layers)
        following = (
            at.engine.direct.plans(
                namespace, who.name, PLAN_SECONDS, body.next_plans, settings.max_plans_per_key
            )
            if body.next_plans
            else []
        )
        return WriteCommitted(
            results=[PutItem.of(r) for r in results], next=[_model(p, budget) for p in following]
        )

    return await at.deadline.run(store, at.namespace, what="the commit", reservation=reservation)
