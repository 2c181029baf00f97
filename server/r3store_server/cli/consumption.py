"""`r3store checkpoints` (list, delete, resume) and `leases`: what a namespace's trainer
consumed, checkpointed at its steps, and holds under open leases now."""

from __future__ import annotations

import argparse
from typing import TypedDict

from r3store.engine import Engine
from r3store_server.cli.arguments import step
from r3store_server.cli.commands import Commands, Fields, on_engine


class Checkpoints(TypedDict):
    """`checkpoints list`: a namespace's checkpoints by step, and its epoch."""

    namespace: str
    epoch: int
    checkpoints: list[Fields]  # each Checkpoint's fields but its namespace


class CheckpointDeleted(TypedDict):
    namespace: str
    step: int
    deleted: bool


class LeaseRow(TypedDict):
    """An open lease as `leases` prints it."""

    lease_id: str
    holder: str | None  # the API key that took it
    size: int  # trajectories
    epoch: int
    created_at: float
    expires_in_seconds: float


class OpenLeases(TypedDict):
    namespace: str
    epoch: int
    leases: list[LeaseRow]  # oldest first


def checkpoints(
    engine: Engine, args: argparse.Namespace
) -> Checkpoints | CheckpointDeleted | Fields:
    """A namespace's step checkpoints (and its epoch); deleting one; resuming to one."""
    consumption, ns = engine.consumption, args.name
    if args.action == "delete":
        consumption.delete_checkpoint(ns, args.step)
        return {"namespace": ns, "step": args.step, "deleted": True}
    if args.action == "resume":
        if not args.yes:
            raise SystemExit(
                f"this undoes what {ns!r} consumed after step {args.step}'s checkpoint, fences "
                "off its open leases and drops its later checkpoints: pass --yes"
            )
        return consumption.resume(ns, args.step).to_dict()  # what it did: Resumed's fields
    found = consumption.checkpoints(ns)
    return {
        "namespace": ns,
        "epoch": consumption.epoch(ns),
        "checkpoints": [
            {k: v for k, v in point.to_dict().items() if k != "namespace"} for point in found
        ],
    }


def leases(engine: Engine, ns: str) -> OpenLeases:
    """A namespace's open, unexpired leases, oldest first, and its epoch."""
    found = engine.consumption.open_leases(ns)
    now = engine.clock()
    return {
        "namespace": ns,
        "epoch": engine.consumption.epoch(ns),
        "leases": [
            {
                "lease_id": lease.lease_id,
                "holder": lease.holder,
                "size": len(lease.trajectory_ids),
                "epoch": lease.epoch,
                "created_at": lease.created_at,
                "expires_in_seconds": round(max(lease.expires_at - now, 0.0), 1),
            }
            for lease in found
        ],
    }


def add_commands(commands: Commands) -> None:
    """`checkpoints` and its actions, and `leases`."""
    cps = commands.actions(
        commands.add(
            "checkpoints", "list, delete or resume from step checkpoints", on_engine(checkpoints)
        )
    )
    cps_list = cps.add("list", "a namespace's checkpoints by step, and its epoch")
    cps_list.add_argument("name", help="the namespace")
    cps_delete = cps.add(
        "delete", "forget a checkpoint (routes only it kept become retention's again)"
    )
    cps_resume = cps.add(
        "resume",
        "return a namespace's consumption to a checkpoint: undo what was committed "
        "after it, fence open leases, drop later checkpoints, start a new epoch",
    )
    for action in (cps_delete, cps_resume):
        action.add_argument("name", help="the namespace")
        action.add_argument("step", type=step, help="the checkpoint's trainer step")
    cps_resume.add_argument("--yes", action="store_true", help="really resume")

    held = commands.add(
        "leases",
        "a namespace's open leases: holder, size, expiry",
        on_engine(lambda engine, args: leases(engine, args.name)),
    )
    held.add_argument("name", help="the namespace")
