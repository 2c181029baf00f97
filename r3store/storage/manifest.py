"""Namespace manifests (`namespaces/<name>.json`, docs/format.md): the record of a
namespace the object store keeps, written on every change of its settings or policy
version, and read by a catalog rebuild. One JSON object: `name`, `spec`, `settings`,
`policy_version`, `created_at`."""

from __future__ import annotations

import json

from r3store.catalog_types import NamespaceInfo
from r3store.policy import NamespaceSettings
from r3store.spec import RouteSpec


def manifest(info: NamespaceInfo) -> bytes:
    """The manifest of a namespace."""
    return json.dumps(
        {
            "name": info.name,
            "spec": json.loads(info.spec.to_json()),
            "settings": info.settings.model_dump(mode="json"),
            "policy_version": info.policy_version,
            "created_at": info.created_at,
        }
    ).encode()


def parse_manifest(data: bytes) -> NamespaceInfo:
    """The namespace a manifest records; ValueError, KeyError, TypeError or an
    `R3StoreError` when it does not hold one."""
    record = json.loads(data)
    return NamespaceInfo(
        record["name"],
        RouteSpec(**record["spec"]),
        float(record["created_at"]),
        int(record.get("policy_version", 0)),
        NamespaceSettings.model_validate(record.get("settings", {})),
    )
