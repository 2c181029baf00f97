"""The server's API keys (`catalog.keys`): digests only, never the keys themselves."""

from __future__ import annotations

import json
import time

import sqlalchemy as sa

from r3store.catalog_types import ApiKeyRecord
from r3store.errors import Conflict, NotFound
from r3store.storage.catalog.database import Repository
from r3store.storage.catalog.tables import api_keys


class Keys(Repository):
    def add(self, name: str, role: str, namespaces: list[str], digest: bytes) -> None:
        """A new key. A revoked key's name may be taken again: its row, digest and all,
        gives way to the new one, so the old key stays unknown (refused) everywhere."""
        try:
            with self._db.begin() as conn:
                conn.execute(
                    api_keys.delete().where(
                        api_keys.c.name == name, api_keys.c.revoked_at.is_not(None)
                    )
                )
                conn.execute(
                    api_keys.insert().values(
                        name=name,
                        role=role,
                        namespaces=json.dumps(namespaces),
                        digest=digest,
                        created_at=time.time(),
                    )
                )
        except Conflict:
            raise Conflict(
                f"an active API key named {name!r} exists: revoke it first to reuse the name"
            ) from None

    def all(self, active_only: bool = False) -> list[ApiKeyRecord]:
        query = sa.select(api_keys).order_by(api_keys.c.name)
        if active_only:
            query = query.where(api_keys.c.revoked_at.is_(None))
        with self._db.connect() as conn:
            return [
                ApiKeyRecord(
                    r.name, r.role, json.loads(r.namespaces), r.digest, r.created_at, r.revoked_at
                )
                for r in conn.execute(query)
            ]

    def revoke(self, name: str) -> None:
        with self._db.begin() as conn:
            done = conn.execute(
                api_keys.update()
                .where(api_keys.c.name == name, api_keys.c.revoked_at.is_(None))
                .values(revoked_at=time.time())
            )
        if done.rowcount == 0:
            raise NotFound(f"no active API key named {name!r}")
