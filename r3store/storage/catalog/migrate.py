"""The catalog's schema version: Alembic revisions (`migrations/versions`), recorded in the
database's `alembic_version` table.

Opening a catalog (`Catalog(url)`) brings its schema to the newest revision this code
knows (`head`), under a lock that holds other migrations off (SQLite `BEGIN IMMEDIATE`,
PostgreSQL an advisory lock), so that servers opening one database at once migrate it
once:

- an empty database: the tables are created and the revision recorded;
- a catalog made before migrations, with no `alembic_version`: stamped at the revision
  whose schema it has exactly (`0001`, or the newest), or, when it is older than that
  (made before route sources, compression at rest, the ledger), brought up to it by
  revision `0001`; then upgraded;
- a catalog at an older revision: upgraded;
- a catalog at a revision this code does not know (written by a newer r3store):
  refused with `InvalidConfig`, naming both revisions, and left untouched.

`r3store migrate` shows the same plan (`plan`) and carries it out (`upgrade`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from alembic.util.exc import CommandError
from sqlalchemy.engine import Connection

from r3store.errors import InvalidConfig
from r3store.storage.catalog import tables
from r3store.storage.catalog.database import Database

MIGRATIONS = Path(__file__).parent / "migrations"
BEFORE_MIGRATIONS = "0001"  # the schema of catalogs made before migrations began

NOTHING = "nothing"  # at the newest revision
CREATE = "create"  # an empty database: create the tables
STAMP = "stamp"  # made before migrations, with the schema of BEFORE_MIGRATIONS exactly
UPGRADE = "upgrade"  # an older revision, or a catalog made before that schema


@dataclass(frozen=True)
class Plan:
    """Where a catalog's schema stands and what opening it does."""

    current: str | None  # the recorded revision; None: none recorded
    head: str  # the newest revision this code knows
    action: str  # NOTHING, CREATE, STAMP or UPGRADE
    stamp: str | None = None  # STAMP: the revision whose schema the catalog has

    def describe(self) -> str:
        current = self.current or "none recorded"
        if self.action == NOTHING:
            return f"the catalog's schema is at revision {self.head}, the newest: nothing to do"
        if self.action == CREATE:
            return f"an empty database: create the catalog's tables at revision {self.head}"
        if self.action == STAMP:
            if self.stamp == self.head:
                return (
                    "a catalog with no recorded revision and the newest schema: record "
                    f"revision {self.head} (alembic_version)"
                )
            return (
                f"a catalog made before migrations with the schema of revision "
                f"{self.stamp}: record that revision, then upgrade to {self.head}"
            )
        return f"upgrade the catalog's schema from revision {current} to {self.head}"


def _config(conn: Connection | None = None) -> Config:
    config = Config()
    config.set_main_option("script_location", str(MIGRATIONS))
    config.attributes["connection"] = conn
    return config


def _script() -> ScriptDirectory:
    return ScriptDirectory.from_config(_config())


def head() -> str:
    """The newest revision this code knows."""
    found = _script().get_current_head()
    assert found is not None
    return found


def _frozen(revision: str) -> sa.MetaData:
    found = _script().get_revision(revision)
    assert found is not None
    module: ModuleType = found.module
    metadata: sa.MetaData = module.metadata
    return metadata


def _state(conn: Connection) -> Plan:
    script = _script()
    newest = head()
    current = MigrationContext.configure(conn).get_current_revision()
    if current is not None:
        try:
            script.get_revision(current)
        except CommandError:
            raise InvalidConfig(
                f"the catalog's schema is at revision {current}, which this r3store does not "
                f"know (its newest is {newest}): a newer r3store wrote it; run that version, "
                "or restore a backup of the catalog"
            ) from None
        return Plan(current, newest, NOTHING if current == newest else UPGRADE)
    inspector = sa.inspect(conn)
    present = set(inspector.get_table_names())
    frozen = _frozen(BEFORE_MIGRATIONS)
    if not present & set(frozen.tables):
        return Plan(None, newest, CREATE)
    if _has_exactly(inspector, present, tables.metadata):
        return Plan(None, newest, STAMP, newest)
    if _has_exactly(inspector, present, frozen):
        return Plan(None, newest, STAMP, BEFORE_MIGRATIONS)
    return Plan(None, newest, UPGRADE)


def _has_exactly(inspector: sa.Inspector, present: set[str], metadata: sa.MetaData) -> bool:
    """Whether the database holds `metadata`'s tables with exactly their columns."""
    return all(
        name in present
        and [c["name"] for c in inspector.get_columns(name)] == [c.name for c in table.columns]
        for name, table in metadata.tables.items()
    )


def plan(db: Database) -> Plan:
    """Where the catalog's schema stands and what `upgrade` would do; raises
    `InvalidConfig` for a catalog newer than this code."""
    with db.connect() as conn:
        return _state(conn)


def upgrade(db: Database) -> Plan:
    """Bring the catalog's schema to the newest revision (see the module docstring);
    returns what was found and done. Another process migrating at the same time waits
    (up to the catalog's timeout), then finds nothing to do."""
    found = plan(db)
    if found.action == NOTHING:
        return found
    with db.exclusive() as conn:
        found = _state(conn)  # again, under the lock
        if found.action == NOTHING:
            return found
        config = _config(conn)
        if found.action == STAMP:
            assert found.stamp is not None
            command.stamp(config, found.stamp)
        command.upgrade(config, "head")
    return found


def check(db: Database) -> None:
    """Refuse a catalog whose schema is not at the newest revision (`r3store migrate`
    brings it there)."""
    found = plan(db)
    if found.action != NOTHING:
        raise InvalidConfig(
            f"{found.describe()}: run `r3store migrate` first (the catalog is opened "
            "without upgrading it)"
        )


def plan_at(url: str, timeout: float = 10.0) -> Plan:
    """`plan` of the catalog at `url` (`r3store migrate --dry-run`)."""
    return _at(url, timeout, plan)


def upgrade_at(url: str, timeout: float = 10.0) -> Plan:
    """`upgrade` of the catalog at `url` (`r3store migrate`)."""
    return _at(url, timeout, upgrade)


def _at(url: str, timeout: float, run: Callable[[Database], Plan]) -> Plan:
    """`run` on the catalog at `url`, opened for it alone."""
    db = Database(url, timeout)
    try:
        return run(db)
    finally:
        db.close()
