"""`r3store maintain`: one pass of retention, compaction, compression at rest and
collection now, or with `--dry-run` what one would do."""

from __future__ import annotations

import argparse
from typing import TypedDict

from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.logic.rest import REST_LEVEL
from r3store_server.cli.commands import Commands, Fields, on_engine
from r3store_server.cli.output import progress


class Dropped(TypedDict):
    trajectories: int
    first: list[str]  # the first five ids


class Deletion(TypedDict):
    key: str
    why: str


class MaintenancePlan(TypedDict):
    """`maintain --dry-run`: what a pass would do now (`MaintenancePreview`)."""

    dry_run: bool
    drop: dict[str, Dropped]  # what retention drops, by namespace
    retire: list[str]
    compact: list[str]
    merge_at_rest: list[list[str]]
    delete: list[Deletion]
    left_alone: list[str]
    deletes_nothing_because: str | None


def maintain(engine: Engine, args: argparse.Namespace) -> Fields | MaintenancePlan:
    """One maintenance pass now (`MaintenanceReport`'s fields), or with `--dry-run` what one
    would do."""
    maintenance = engine.upkeep.maintenance(
        MaintenanceOptions(
            grace_seconds=args.grace,
            orphan_seconds=args.orphan_age,
            cold_seconds=args.cold_age,
            rest_level=args.rest_level,
        )
    )
    if not args.dry_run:
        return maintenance.run(progress("shards")).__dict__
    preview = maintenance.preview()
    return {
        "dry_run": True,
        "drop": {
            ns: {"trajectories": len(ids), "first": ids[:5]}
            for ns, ids in preview.retention.items()
        },
        "retire": preview.retire,
        "compact": preview.compact,
        "merge_at_rest": preview.rest,
        "delete": [{"key": key, "why": why} for key, why in preview.delete],
        "left_alone": preview.unknown,
        "deletes_nothing_because": preview.behind,
    }


def add_commands(commands: Commands) -> None:
    """`maintain` and its ages, `--dry-run` and `--rest-level`."""
    maintain_ = commands.add(
        "maintain",
        "run retention, compaction, compression at rest and collection now",
        on_engine(maintain),
    )
    maintain_.add_argument(
        "--grace", type=float, default=600.0, help="seconds a retired shard stays readable"
    )
    maintain_.add_argument(
        "--orphan-age",
        type=float,
        default=3600.0,
        help="seconds before an object no catalog row names is deleted",
    )
    maintain_.add_argument(
        "--cold-age",
        type=float,
        default=600.0,
        help="seconds after which shards are merged and compressed again at rest",
    )
    maintain_.add_argument(
        "--dry-run",
        action="store_true",
        help="show what a pass would drop, rewrite and delete, changing nothing",
    )
    maintain_.add_argument(
        "--rest-level",
        type=int,
        choices=range(1, 23),
        default=REST_LEVEL,
        metavar="1-22",
        help="the zstd level of rows compressed again at rest",
    )
