"""Namespaces (one RL run each) and their control plane: settings and policy version."""

from __future__ import annotations

from fastapi import APIRouter, Response

from r3store.policy import NamespaceSettings
from r3store.protocol.models import (
    NamespaceCreate,
    NamespaceDeleted,
    NamespaceList,
    NamespacePublic,
    PolicyVersionSet,
)
from r3store_server.deps import (
    DeadlineDep,
    EngineDep,
    KeyRingDep,
    NamespaceDep,
    PrincipalDep,
    SettingsDep,
    allowed,
)
from r3store_server.errors import ERROR_RESPONSES

router = APIRouter(prefix="/v1/namespaces", tags=["namespaces"], responses=ERROR_RESPONSES)


@router.post(
    "",
    status_code=201,
    response_model=NamespacePublic,
    responses={200: {"model": NamespacePublic, "description": "it exists, identical"}},
    dependencies=[allowed("manage")],  # the right before the body; its scope below
)
async def create_namespace(
    body: NamespaceCreate,
    response: Response,
    engine: EngineDep,
    keys: KeyRingDep,
    who: PrincipalDep,
    deadline: DeadlineDep,
) -> NamespacePublic:
    """Create a namespace with its route spec (fixed) and settings: 201. The same
    request again answers 200; another spec or other settings under the name, 409.
    Admin (the name is in the body, so the key's namespace scope is checked here)."""
    keys.authorize(who, "manage", body.name)
    info, created = await deadline.run(
        engine.namespaces.create, body.name, body.spec.to_spec(), body.settings
    )
    if not created:
        response.status_code = 200
    return NamespacePublic.of(info)


@router.get("", response_model=NamespaceList, dependencies=[allowed("describe")])
async def list_namespaces(
    engine: EngineDep, who: PrincipalDep, deadline: DeadlineDep
) -> NamespaceList:
    """The namespaces this key may see."""
    infos = await deadline.run(engine.namespaces.all)
    return NamespaceList(
        namespaces=[NamespacePublic.of(i) for i in infos if who.may("describe", i.name)]
    )


@router.get("/{namespace}", response_model=NamespacePublic, dependencies=[allowed("describe")])
async def describe_namespace(at: NamespaceDep) -> NamespacePublic:
    """Spec, settings, current policy version and trajectory count."""
    info = await at.run(at.engine.namespaces.get)
    count = await at.run(at.engine.namespaces.count)
    return NamespacePublic.of(info, count)


@router.delete("/{namespace}", response_model=NamespaceDeleted, dependencies=[allowed("manage")])
async def delete_namespace(at: NamespaceDep) -> NamespaceDeleted:
    """Delete a namespace, its trajectories and its objects. Admin."""
    deleted = await at.run(at.engine.namespaces.delete)
    return NamespaceDeleted(name=at.namespace, objects_deleted=deleted)


@router.put(
    "/{namespace}/settings", response_model=NamespacePublic, dependencies=[allowed("manage")]
)
async def update_settings(body: NamespaceSettings, at: NamespaceDep) -> NamespacePublic:
    """Replace the staleness, sampling and retention settings. Admin."""
    return NamespacePublic.of(await at.run(at.engine.namespaces.update_settings, body))


@router.put(
    "/{namespace}/policy-version",
    response_model=NamespacePublic,
    dependencies=[allowed("policy")],
)
async def set_policy_version(
    body: PolicyVersionSet,
    at: NamespaceDep,
    settings: SettingsDep,
    keys: KeyRingDep,
    who: PrincipalDep,
) -> NamespacePublic:
    """The trainer's current policy version: forward only, at most
    `R3STORE_MAX_POLICY_STEP` per call. Trainer or admin; `force` (set it as given, back
    or any distance forward: a repair) takes an admin key."""
    if body.force:
        keys.authorize(who, "manage", at.namespace)
    info = await at.run(
        at.engine.namespaces.set_policy_version,
        body.policy_version,
        settings.max_policy_step,
        body.force,
    )
    return NamespacePublic.of(info)
