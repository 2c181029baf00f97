"""`r3store keys` (create, list, revoke): API keys in the catalog. A key is shown once, at
creation; only its SHA-256 digest is stored."""

from __future__ import annotations

import argparse
import secrets
from typing import TypedDict

from r3store.engine import Engine
from r3store_server.auth import digest
from r3store_server.cli.commands import Commands, on_engine


class KeyCreated(TypedDict):
    name: str
    role: str
    namespaces: list[str]
    key: str  # shown this once


class KeyRevoked(TypedDict):
    name: str
    revoked: bool


class KeyRow(TypedDict):
    """A key as `keys list` prints it, without the key."""

    name: str
    role: str
    namespaces: list[str]
    revoked: bool


def keys(engine: Engine, args: argparse.Namespace) -> KeyCreated | KeyRevoked | list[KeyRow]:
    """API keys in the catalog: the key itself is shown once, at creation; only its
    SHA-256 digest is stored."""
    if args.action == "create":
        key = secrets.token_urlsafe(32)
        namespaces = args.namespace or ["*"]
        engine.keys.add(args.name, args.role, namespaces, digest(key))
        return {"name": args.name, "role": args.role, "namespaces": namespaces, "key": key}
    if args.action == "revoke":
        engine.keys.revoke(args.name)
        return {"name": args.name, "revoked": True}
    return [
        {
            "name": k.name,
            "role": k.role,
            "namespaces": k.namespaces,
            "revoked": k.revoked_at is not None,
        }
        for k in engine.keys.all()
    ]


def add_commands(commands: Commands) -> None:
    """`keys` and its actions."""
    actions = commands.actions(
        commands.add("keys", "create, list or revoke API keys", on_engine(keys))
    )
    make = actions.add(
        "create",
        "a new key, shown once (turns authentication on, within 5 s, on a server that had none)",
    )
    make.add_argument("name", help="who the key is for")
    make.add_argument(
        "--role",
        choices=["writer", "reader", "trainer", "admin"],
        required=True,
        help="writer: upload; reader: read, sample and lease; trainer: a reader that also "
        "sets the policy version and records and resumes from step checkpoints; admin: "
        "everything",
    )
    make.add_argument(
        "--namespace", action="append", help="a namespace it may use (repeatable); default: all"
    )
    actions.add("list", "every key, without the keys themselves")
    revoke = actions.add("revoke", "revoke a key (within 5 s)")
    revoke.add_argument("name", help="the key's name")
