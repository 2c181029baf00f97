"""`r3store`: the operator's command line, working on the store and catalog directly.

It finds the store as the server does (the same `R3STORE_*` settings: by default the
embedded store in `./data`), says on stderr which one it opened, and refuses to make a
new, empty embedded store unless asked (`--init`).

    r3store namespaces list
    r3store namespaces create run1 --layers 48 --experts 128 --top-k 8
    r3store policy run1 --version 12
    r3store settings run1 --max-lag 2 --keep-versions 4 --ttl 86400
    r3store settings run1 --max-lag none     # only what is given changes; none clears
    r3store settings run1 --keep-checkpoints 5
    r3store stats [run1]
    r3store stats run1 --experts  # expert load, agreement between sources, drift
    r3store maintain            # retention, compaction and collection, now
    r3store checkpoints list run1            # the trainer's step checkpoints, its epoch
    r3store checkpoints resume run1 120 --yes   # consumption back to step 120's
    r3store checkpoints delete run1 100
    r3store leases run1                      # open leases: holder, size, expiry
    r3store keys create trainer --role trainer --namespace run1   # shows the key once
    r3store keys revoke trainer
    r3store rebuild --yes       # the catalog again, from the object store alone
    r3store migrate [--dry-run] # the catalog's schema to this version's

Every command takes `--json` for scripts. Long operations show progress on stderr when
it is a terminal.

Each group of commands is a module that adds its subcommands with what runs them
(`namespaces`, `consumption`, `statistics`, `maintenance`, `api_keys`, `catalog`); this
one puts them in one parser and runs the command it names.
"""

from __future__ import annotations

import argparse
import sys

import r3store
from r3store.errors import InvalidConfig, R3StoreError
from r3store_server.cli import (
    api_keys,
    catalog,
    consumption,
    maintenance,
    namespaces,
    statistics,
)
from r3store_server.cli.api_keys import keys
from r3store_server.cli.arguments import CLEAR, DURATIONS
from r3store_server.cli.catalog import migrate
from r3store_server.cli.commands import Command, Commands, Output, open_engine
from r3store_server.cli.consumption import checkpoints, leases
from r3store_server.cli.maintenance import maintain
from r3store_server.cli.namespaces import SETTINGS_FLAGS, changed
from r3store_server.cli.output import human, write
from r3store_server.cli.statistics import route_stats, stats
from r3store_server.settings import Settings, load_settings, unknown_variables

__all__ = [
    "CLEAR",
    "DURATIONS",
    "SETTINGS_FLAGS",
    "changed",
    "checkpoints",
    "human",
    "keys",
    "leases",
    "main",
    "maintain",
    "migrate",
    "open_engine",
    "parser",
    "route_stats",
    "run",
    "stats",
]

# the groups of commands, in the order `r3store --help` lists them
_GROUPS = (namespaces, consumption, statistics, maintenance, api_keys, catalog)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="r3store",
        description=__doc__.splitlines()[0].strip("`").replace("`", ""),
        epilog="The store and catalog come from R3STORE_* variables, as for r3store-server "
        "(r3store-server --help lists them).",
    )
    p.add_argument("--version", action="version", version=f"r3store {r3store.__version__}")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument(
        "--init",
        action="store_true",
        help="create a new, empty store and catalog (the embedded store in R3STORE_DATA_DIR, "
        "a SQLite catalog file, or an empty bucket prefix); without it, only existing ones open",
    )
    common = argparse.ArgumentParser(add_help=False)  # --json after the command, too
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    commands = Commands(p.add_subparsers(dest="command", required=True, metavar="COMMAND"), common)
    for group in _GROUPS:
        group.add_commands(commands)
    return p


def run(args: argparse.Namespace, settings: Settings) -> Output:
    """The command `args` names, on the store and catalog the settings name."""
    command: Command = args.run
    return command(args, settings)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = load_settings()
        for name in unknown_variables():
            print(f"r3store: warning: {name} is not a setting (a typo?)", file=sys.stderr)
        write(run(args, settings), args.json)
    except InvalidConfig as exc:
        print(f"r3store: {exc}", file=sys.stderr)
        return 2
    except R3StoreError as exc:
        print(f"r3store: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"r3store: {exc}", file=sys.stderr)
        return 2
    return 0
