"""Namespaces, the engine's part for them (`Engine.namespaces`): one RL run each, with
its fixed route spec, its settings and its policy version, in the catalog and, as a
manifest (`r3store.storage.manifest`), in the object store that a catalog rebuild reads.

    info, created = engine.namespaces.create("run1", RouteSpec(48, 128, 8))
    engine.namespaces.set_policy_version("run1", 3)
    engine.namespaces.usage("run1").trajectories

Every change of a namespace writes its manifest again; `spec` is cached (a namespace's
spec never changes).
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable

from r3store.catalog_types import NamespaceInfo, NamespaceUsage
from r3store.errors import Conflict, InvalidInput, NotFound, ObjectExists
from r3store.policy import NamespaceSettings
from r3store.records import check_namespace
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.keys import TOMBSTONE_PREFIX, namespace_key
from r3store.storage.manifest import manifest, parse_manifest
from r3store.storage.store.base import ObjectStore


def _same_namespace(
    existing: NamespaceInfo, spec: RouteSpec, settings: NamespaceSettings
) -> NamespaceInfo:
    """`existing`, if a request to create it with `spec` and `settings` is a repeat."""
    differ = [
        f"{name} {getattr(existing.spec, name)!r}, not {getattr(spec, name)!r}"
        for name in RouteSpec.__dataclass_fields__
        if getattr(existing.spec, name) != getattr(spec, name)
    ]
    have, want = existing.settings.model_dump(), settings.model_dump()
    differ += [f"{key} {have[key]!r}, not {want[key]!r}" for key in have if have[key] != want[key]]
    if differ:
        raise Conflict(
            f"namespace {existing.name!r} exists with other settings: {'; '.join(differ)} "
            "(change settings with PUT .../settings)"
        )
    return existing


class Namespaces:
    """The namespaces of one store and its catalog."""

    def __init__(self, store: ObjectStore, catalog: Catalog, clock: Callable[[], float]) -> None:
        """`clock` stamps a new namespace's creation."""
        self._store = store
        self._catalog = catalog
        self._clock = clock
        self._specs: dict[str, RouteSpec] = {}
        self._lock = threading.Lock()

    def create(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> tuple[NamespaceInfo, bool]:
        """Create a namespace (one RL run) with its fixed route spec and its settings;
        returns it and whether it was made now.

        The same call again is an idempotent success (`False`); an existing namespace
        with another spec or other settings is a `Conflict` naming what differs. The
        manifest goes to the object store first (create-only), so a catalog rebuild
        finds namespaces that hold no shards yet.
        """
        check_namespace(name)
        settings = settings or NamespaceSettings()
        try:
            return _same_namespace(self._catalog.namespaces.get(name), spec, settings), False
        except NotFound:
            pass
        info = NamespaceInfo(name, spec, self._clock(), 0, settings)
        had_manifest = False
        try:
            self._store.put_if_absent(namespace_key(name), manifest(info))
        except ObjectExists:  # made elsewhere just now, or a catalog that lost it
            stored = parse_manifest(self._store.get(namespace_key(name)))
            if stored.spec != spec:
                raise Conflict(f"namespace {name!r} exists with another route spec") from None
            info = dataclasses.replace(info, created_at=stored.created_at)
            had_manifest = True
        made, created = self._catalog.namespaces.create(name, spec, settings, info.created_at)
        if not created:
            return _same_namespace(made, spec, settings), False
        if had_manifest:  # the manifest says what the catalog now holds
            self._store.put(namespace_key(name), manifest(made))
        return made, True

    def get(self, name: str) -> NamespaceInfo:
        """The namespace; `NotFound` for an unknown name."""
        return self._catalog.namespaces.get(check_namespace(name))

    def all(self) -> list[NamespaceInfo]:
        return self._catalog.namespaces.all()

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespaceInfo:
        info = self._catalog.namespaces.update_settings(check_namespace(name), settings)
        self._store.put(namespace_key(name), manifest(info))
        return info

    def set_policy_version(
        self, name: str, version: int, max_step: int | None = None, force: bool = False
    ) -> NamespaceInfo:
        """The trainer's current policy version; it only moves forward, by at most
        `max_step` (None: any distance). `force`: set it as given, back or forward (an
        operator's repair)."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"policy version must be a non-negative integer, got {version!r}")
        info = self._catalog.namespaces.set_policy_version(
            check_namespace(name), version, max_step, force
        )
        self._store.put(namespace_key(name), manifest(info))
        return info

    def write_manifest(self, name: str) -> NamespaceInfo:
        """Write the namespace's manifest again from the catalog (after a change made
        there, such as a resume setting the policy version back)."""
        info = self.get(name)
        self._store.put(namespace_key(name), manifest(info))
        return info

    def delete(self, name: str) -> int:
        """Delete a namespace, its trajectories and its objects; returns objects deleted.

        The catalog forgets everything first; objects go only after that.
        """
        keys = self._catalog.namespaces.delete(check_namespace(name))
        with self._lock:
            self._specs.pop(name, None)
        for key in keys:  # marked as deletions under way: maintenance finishes a failure
            self._store.delete(key)
            self._catalog.ledger.forget_upload(key)
        tombstones = [info.key for info in self._store.list(f"{TOMBSTONE_PREFIX}{name}/")]
        for key in tombstones:
            self._store.delete(key)
        self._store.delete(namespace_key(name))
        return len(keys) + len(tombstones) + 1

    def spec(self, name: str) -> RouteSpec:
        """The namespace's route spec (cached)."""
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            spec = self.get(name).spec
            with self._lock:
                self._specs[name] = spec
        return spec

    def forget_specs(self) -> None:
        """Drop the cached specs (the catalog was made again)."""
        with self._lock:
            self._specs.clear()

    def count(self, name: str) -> int:
        """Trajectories in the namespace."""
        return self._catalog.segments.count(check_namespace(name))

    def usage(self, name: str) -> NamespaceUsage:
        """Trajectories by policy version, shards and their live and dead bytes."""
        self.get(name)  # NotFound for unknown names
        shards = self._catalog.shards.usage(name)
        samplings, sampled = self._catalog.segments.sampling_totals(name)
        return NamespaceUsage(
            trajectories=self._catalog.segments.count(name),
            shards=len(shards),
            shard_bytes=sum(u.size for u in shards),
            live_route_bytes=sum(u.live_bytes for u in shards),
            dead_route_bytes=sum(u.route_bytes - u.live_bytes for u in shards),
            by_policy_version=self._catalog.segments.count_by_version(name),
            samplings=samplings,
            sampled=sampled,
        )
