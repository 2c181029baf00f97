"""What the command modules share: `Commands`, where each adds its subcommands with what
runs them; `Output`, the type of what a command prints; and the engine a command runs on
(`open_engine`), which is never a new, empty store or catalog unless asked."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeAlias

from r3store.engine import Engine
from r3store.errors import InvalidConfig
from r3store_server.backends import bound, build_engine, sqlite_path
from r3store_server.settings import Settings

Output: TypeAlias = Mapping[str, object] | Sequence[Mapping[str, object]]
"""What a command prints: a record, or a list of records (JSON objects either way)."""
Fields: TypeAlias = dict[str, Any]
"""A value of the engine's as a record: its fields by name (`to_dict()`, `__dict__`)."""
Command: TypeAlias = Callable[[argparse.Namespace, Settings], Output]
"""What runs a subcommand: its parsed arguments and the settings in, what it prints out."""


@dataclass(frozen=True)
class Commands:
    """Where subcommands register: the subparsers of a parser, and the parser whose
    options every subcommand takes after its name too (`--json`)."""

    sub: argparse._SubParsersAction[argparse.ArgumentParser]
    common: argparse.ArgumentParser

    def add(self, name: str, help: str, run: Command | None = None) -> argparse.ArgumentParser:
        """The subcommand `name`; `run` runs it and its actions."""
        parser = self.sub.add_parser(name, parents=[self.common], help=help)
        if run is not None:
            parser.set_defaults(run=run)
        return parser

    def actions(self, parser: argparse.ArgumentParser) -> Commands:
        """Where the actions of the subcommand `parser` register (`keys create`, ...)."""
        sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
        return Commands(sub, self.common)


def on_engine(command: Callable[[Engine, argparse.Namespace], Output]) -> Command:
    """`command` run on the engine the settings name (`open_engine`), closed after."""

    def run(args: argparse.Namespace, settings: Settings) -> Output:
        with open_engine(settings, args.init) as engine:
            return command(engine, args)

    return run


def open_engine(settings: Settings, init: bool, bind: bool = True) -> Engine:
    """The engine the settings name, bound to its store (`bind`; a rebuild binds after);
    refuses to make a new store or catalog unless `init`."""
    catalog_file = sqlite_path(settings)
    if settings.store == "local" and not settings.data_dir.exists() and not init:
        raise InvalidConfig(
            f"no store at {settings.data_dir.resolve()} (R3STORE_DATA_DIR): run r3store "
            "where the server keeps its data, set R3STORE_DATA_DIR (or R3STORE_STORE=s3 and "
            "R3STORE_S3__*), or pass --init to create a new, empty store there"
        )
    # the embedded store is asked for by its directory; a bucket prefix by --init
    init = init or settings.store == "local"
    if not init:
        require_catalog(catalog_file, ", or pass --init to create a new, empty one")
    engine = build_engine(settings)
    print(
        f"r3store: store {engine.store_description}, catalog {settings.catalog_description()}",
        file=sys.stderr,
    )
    return bound(engine, settings, init) if bind else engine


def require_catalog(catalog_file: Path | None, hint: str = "") -> None:
    """Refuses a SQLite catalog file (`sqlite_path`) that is not there, rather than make a
    new, empty one; `hint` ends the message."""
    if catalog_file is not None and not catalog_file.exists():
        raise InvalidConfig(
            f"no catalog at {catalog_file} (R3STORE_CATALOG_URL, or R3STORE_DATA_DIR): point "
            f"the settings at the server's catalog{hint}"
        )
