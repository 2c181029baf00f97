"""`r3store rebuild`, the catalog made again from the object store alone, and `migrate`,
its schema brought to this version's."""

from __future__ import annotations

import argparse
from typing import Any

from r3store_server.backends import migrate_catalog, sqlite_path
from r3store_server.cli.commands import Commands, Fields, open_engine, require_catalog
from r3store_server.cli.output import progress
from r3store_server.settings import Settings


def rebuild(args: argparse.Namespace, settings: Settings) -> Fields:
    """`r3store rebuild --yes`: the catalog's content replaced by what the store holds
    (`RebuildReport`'s fields)."""
    if not args.yes:
        raise SystemExit("rebuild replaces the catalog's content: pass --yes")
    with open_engine(settings, args.init, bind=False) as engine:
        return engine.upkeep.rebuild(progress("rebuild")).__dict__


def migrate(settings: Settings, dry_run: bool) -> dict[str, Any]:
    """`r3store migrate`: the catalog's schema revision and the newest, and the upgrade
    (none with `--dry-run`). Needs no store; refuses to make a new SQLite catalog."""
    require_catalog(sqlite_path(settings))
    return migrate_catalog(settings, dry_run)


def add_commands(commands: Commands) -> None:
    """`rebuild` and `migrate`."""
    again = commands.add("rebuild", "rebuild the catalog from the object store", rebuild)
    again.add_argument("--yes", action="store_true", help="really replace the catalog")
    schema = commands.add(
        "migrate",
        "upgrade the catalog's schema to this version's (servers do it when they open it)",
        lambda args, settings: migrate(settings, args.dry_run),
    )
    schema.add_argument(
        "--dry-run", action="store_true", help="print the current and target revision only"
    )
