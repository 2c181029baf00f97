"""The client's calls of a namespace (`NamespaceCalls`, mixed into `Calls`): create it,
read it, ensure it has a spec, move its policy version, replace its settings, and its
statistics (expert load, agreement between route sources, drift, per-trajectory load).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from r3store.errors import Conflict, Forbidden, NotFound
from r3store.policy import NamespaceSettings, Source
from r3store.protocol.models import (
    AgreementModel,
    DriftModel,
    ExpertLoadModel,
    NamespacePublic,
    PolicyVersionSet,
    TrajectoryLoadsModel,
)
from r3store.spec import RouteSpec
from r3store_client.call_base import CallBase, with_status
from r3store_client.steps import Call


def _differing(name: str, stored: RouteSpec, asked: RouteSpec) -> None:
    differing = [
        f"{f.name} {getattr(stored, f.name)!r} (asked: {getattr(asked, f.name)!r})"
        for f in dataclasses.fields(RouteSpec)
        if getattr(stored, f.name) != getattr(asked, f.name)
    ]
    if differing:
        raise with_status(
            Conflict(f"namespace {name!r} exists with another route spec: " + ", ".join(differing)),
            409,
        )


class NamespaceCalls(CallBase):
    """Namespaces, their policy version, settings and statistics; mixed into `Calls`."""

    def _create_namespace(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> Call[NamespacePublic]:
        """Create a namespace (an admin key); `Conflict` when the name is taken."""
        body = {
            "name": name,
            "spec": spec.__dict__,
            "settings": (settings or NamespaceSettings()).model_dump(mode="json"),
        }
        answer = yield from self._json("POST", "/v1/namespaces", json=body)
        return NamespacePublic.model_validate(answer)

    def _namespace(self, name: str) -> Call[NamespacePublic]:
        """The namespace: its spec, settings, policy version and usage."""
        answer = yield from self._json("GET", f"/v1/namespaces/{name}")
        return NamespacePublic.model_validate(answer)

    def _ensure_namespace(self, name: str, spec: RouteSpec) -> Call[NamespacePublic]:
        """The namespace `name`, which must have `spec`: created (with default settings)
        when it does not exist. Its settings are not compared: they are the operator's
        to change (`r3store settings`), and a worker started again afterwards goes on.

        Reading the namespace needs any role (`writer`, `reader` or `admin`); creating it
        needs `admin` (`Forbidden` says so). Another spec under the name: `Conflict`
        naming the fields that differ.
        """
        try:
            info = yield from self._namespace(name)
        except NotFound:
            try:
                return self._keep_spec(name, (yield from self._create_namespace(name, spec)))
            except Forbidden as exc:
                raise with_status(
                    Forbidden(
                        f"namespace {name!r} does not exist and this key may not create it: "
                        f"creating a namespace needs an admin key (an operator can run "
                        f"`r3store namespaces create {name} ...`); {exc}"
                    ),
                    403,
                ) from None
            except Conflict:  # made meanwhile by someone else: compare with theirs
                info = yield from self._namespace(name)
        _differing(name, info.spec.to_spec(), spec)
        return self._keep_spec(name, info)

    def _keep_spec(self, name: str, info: NamespacePublic) -> NamespacePublic:
        self._specs[name] = info.spec.to_spec()
        return info

    def _spec(self, name: str) -> Call[RouteSpec]:
        """The namespace's route spec (fixed at creation: asked once, then kept)."""
        if name not in self._specs:
            self._specs[name] = (yield from self._namespace(name)).spec.to_spec()
        return self._specs[name]

    def _set_policy_version(
        self, name: str, version: int, force: bool = False
    ) -> Call[NamespacePublic]:
        """Move the namespace's policy version forward (a `trainer` key), at most the
        server's step per call; `force` (an admin key): set it as given, even back."""
        body = PolicyVersionSet(policy_version=version, force=force).model_dump(
            exclude_defaults=True
        )
        path = f"/v1/namespaces/{name}/policy-version"
        return NamespacePublic.model_validate((yield from self._json("PUT", path, json=body)))

    def _update_settings(self, name: str, settings: NamespaceSettings) -> Call[NamespacePublic]:
        """Replace the namespace's settings (an admin key)."""
        body = settings.model_dump(mode="json")
        path = f"/v1/namespaces/{name}/settings"
        return NamespacePublic.model_validate((yield from self._json("PUT", path, json=body)))

    # statistics

    def _expert_load(
        self, namespace: str, source: Source = "engine", versions: tuple[int, int] | None = None
    ) -> Call[ExpertLoadModel]:
        """Expert load per policy version (optionally those in `versions`, inclusive)."""
        params: dict[str, Any] = {"source": source}
        if versions is not None:
            params["min_version"], params["max_version"] = versions
        path = f"/v1/namespaces/{namespace}/stats/experts"
        return ExpertLoadModel.model_validate((yield from self._json("GET", path, params=params)))

    def _agreement(
        self, namespace: str, a: Source = "engine", b: Source = "trainer"
    ) -> Call[AgreementModel]:
        """Agreement per policy version and layer between two route sources."""
        path = f"/v1/namespaces/{namespace}/stats/agreement"
        answer = yield from self._json("GET", path, params={"a": a, "b": b})
        return AgreementModel.model_validate(answer)

    def _drift(self, namespace: str, source: Source = "engine") -> Call[DriftModel]:
        """Per-layer divergence of expert load from each policy version to the next."""
        path = f"/v1/namespaces/{namespace}/stats/drift"
        answer = yield from self._json("GET", path, params={"source": source})
        return DriftModel.model_validate(answer)

    def _trajectory_loads(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[TrajectoryLoadsModel]:
        """Per-expert token counts of each trajectory's routes (as a read would serve
        them), to balance micro-batches across expert-parallel ranks."""
        body = {"ids": list(ids), "include_stale": include_stale, "source": source}
        path = f"/v1/namespaces/{namespace}/stats/experts/trajectories"
        answer = yield from self._json("POST", path, json=body)
        return TrajectoryLoadsModel.model_validate(answer)
