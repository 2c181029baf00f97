"""Namespaces: their spec, settings and current policy version (`catalog.namespaces`)."""

from __future__ import annotations

import time

import sqlalchemy as sa

from r3store.catalog_types import NamespaceInfo
from r3store.errors import Conflict, InvalidInput, NotFound
from r3store.policy import NamespaceSettings
from r3store.spec import RouteSpec
from r3store.storage.catalog import checkpoints, leases, ledger, stats
from r3store.storage.catalog.database import Repository, lock, namespace_of, namespace_row
from r3store.storage.catalog.tables import namespaces, shards, trajectories
from r3store.storage.keys import dictionary_key


class Namespaces(Repository):
    def create(
        self,
        name: str,
        spec: RouteSpec,
        settings: NamespaceSettings | None = None,
        created_at: float | None = None,
    ) -> tuple[NamespaceInfo, bool]:
        """Create a namespace; returns it and True, or what exists under the name and
        False (the caller compares)."""
        made = NamespaceInfo(
            name,
            spec,
            time.time() if created_at is None else created_at,
            0,
            settings or NamespaceSettings(),
        )
        try:
            with self._db.begin() as conn:
                conn.execute(namespaces.insert().values(**namespace_row(made)))
        except Conflict:
            return self.get(name), False
        return self.get(name), True

    def get(self, name: str) -> NamespaceInfo:
        with self._db.connect() as conn:
            row = conn.execute(sa.select(namespaces).where(namespaces.c.name == name)).first()
        if row is None:
            raise NotFound(f"no namespace {name!r}")
        return namespace_of(row)

    def all(self) -> list[NamespaceInfo]:
        """Every namespace, by name."""
        with self._db.connect() as conn:
            rows = conn.execute(sa.select(namespaces).order_by(namespaces.c.name)).all()
        return [namespace_of(r) for r in rows]

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespaceInfo:
        with self._db.begin() as conn:
            done = conn.execute(
                namespaces.update()
                .where(namespaces.c.name == name)
                .values(settings=settings.model_dump_json())
            )
        if done.rowcount == 0:
            raise NotFound(f"no namespace {name!r}")
        return self.get(name)

    def set_policy_version(
        self, name: str, version: int, max_step: int | None = None, force: bool = False
    ) -> NamespaceInfo:
        """Move the namespace's current policy version forward (never back), at most
        `max_step` at once; `force`: to `version`, whatever the current one."""
        with self._db.begin() as conn:
            lock(conn, name)  # against a resume setting it back meanwhile
            row = conn.execute(
                sa.select(namespaces.c.policy_version).where(namespaces.c.name == name)
            ).first()
            if row is None:
                raise NotFound(f"no namespace {name!r}")
            if version < row.policy_version and not force:
                raise InvalidInput(
                    f"policy version {version} is older than the current {row.policy_version} "
                    "(an admin key may set it back with force)"
                )
            if max_step is not None and not force and version - row.policy_version > max_step:
                raise InvalidInput(
                    f"policy version {version} is more than {max_step} ahead of the current "
                    f"{row.policy_version}: move it in steps of at most {max_step}, or an admin "
                    "key sets it with force"
                )
            conn.execute(
                namespaces.update().where(namespaces.c.name == name).values(policy_version=version)
            )
        return self.get(name)

    def delete(self, name: str) -> list[str]:
        """Forget a namespace and its trajectories; returns the keys of its objects this
        catalog made (shards, uploads not committed, dictionaries), to delete. They stay
        on the ledger as deletions under way (`ledger.forget_upload` each once deleted),
        so that collection finishes what a failure leaves."""
        with self._db.begin() as conn:
            lock(conn, name)  # no lease or checkpoint is recorded meanwhile
            keys = list(
                conn.execute(sa.select(shards.c.key).where(shards.c.namespace == name)).scalars()
            )
            keys += [p.key for p in ledger.pending(conn, name)]
            found = ledger.keys_of(conn, name)
            keys += [dictionary_key(ns, digest) for ns, digest in found]
            conn.execute(trajectories.delete().where(trajectories.c.namespace == name))
            conn.execute(shards.delete().where(shards.c.namespace == name))
            stats.delete_namespace(conn, name)
            leases.delete_namespace(conn, name)
            checkpoints.delete_namespace(conn, name)
            ledger.delete_namespace(conn, name)
            ledger.mark_deleting(conn, keys, name)
            done = conn.execute(namespaces.delete().where(namespaces.c.name == name))
            if done.rowcount == 0:
                raise NotFound(f"no namespace {name!r}")
        return keys
