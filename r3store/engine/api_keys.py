"""API keys, the engine's part for them (`Engine.keys`): the keys the server checks
requests against, kept in the catalog by name, role and namespaces, with the digest of
their secret (never the secret itself)."""

from __future__ import annotations

from r3store.catalog_types import ApiKeyRecord
from r3store.storage.catalog import Catalog


class ApiKeys:
    def __init__(self, catalog: Catalog) -> None:
        self._catalog = catalog

    def add(self, name: str, role: str, namespaces: list[str], digest: bytes) -> None:
        self._catalog.keys.add(name, role, namespaces, digest)

    def all(self, active_only: bool = False) -> list[ApiKeyRecord]:
        return self._catalog.keys.all(active_only)

    def revoke(self, name: str) -> None:
        self._catalog.keys.revoke(name)
