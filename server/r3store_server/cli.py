"""`r3store`: the operator's command line, working on the store and catalog directly
(the same `R3STORE_*` settings as the server).

    r3store namespaces list
    r3store namespaces create run1 --layers 48 --experts 128 --top-k 8
    r3store policy run1 --version 12
    r3store settings run1 --max-lag 2 --keep-versions 4 --ttl 86400
    r3store stats [run1]
    r3store maintain            # retention, compaction and collection, now
    r3store keys create trainer --role reader --namespace run1   # shows the key once
    r3store keys revoke trainer
    r3store rebuild --yes       # the catalog again, from the object store alone

Every command takes `--json` for scripts. Long operations show progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
import time
from typing import Any

from r3store.engine import Engine
from r3store.errors import R3StoreError
from r3store.policy import NamespaceSettings, Retention
from r3store.spec import RouteSpec
from r3store_server.auth import digest
from r3store_server.backends import build_engine
from r3store_server.settings import Settings


def _progress(label: str) -> Any:
    started = time.monotonic()

    def show(done: int, total: int) -> None:
        width = 30
        filled = width * done // max(total, 1)
        rate = done / max(time.monotonic() - started, 1e-9)
        sys.stderr.write(
            f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {done}/{total} ({rate:.1f}/s)"
        )
        if done >= total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return show


def _namespace(info: Any, count: int | None = None) -> dict[str, Any]:
    return {
        "name": info.name,
        "spec": info.spec.__dict__,
        "settings": info.settings.model_dump(mode="json"),
        "policy_version": info.policy_version,
        "created_at": info.created_at,
        **({"trajectories": count} if count is not None else {}),
    }


def stats(engine: Engine, name: str | None) -> dict[str, Any]:
    names = [name] if name else [n.name for n in engine.list_namespaces()]
    out: dict[str, Any] = {}
    for ns in names:
        usage = engine.usage(ns)
        out[ns] = {
            **usage.__dict__,
            "by_policy_version": {str(v): n for v, n in usage.by_policy_version.items()},
        }
    return out


def keys(engine: Engine, args: argparse.Namespace) -> Any:
    """API keys in the catalog: the key itself is shown once, at creation; only its
    SHA-256 digest is stored."""
    if args.action == "create":
        key = secrets.token_urlsafe(32)
        namespaces = args.namespace or ["*"]
        engine.add_key(args.name, args.role, namespaces, digest(key))
        return {"name": args.name, "role": args.role, "namespaces": namespaces, "key": key}
    if args.action == "revoke":
        engine.revoke_key(args.name)
        return {"name": args.name, "revoked": True}
    return [
        {
            "name": k.name,
            "role": k.role,
            "namespaces": k.namespaces,
            "revoked": k.revoked_at is not None,
        }
        for k in engine.list_keys()
    ]


def _print(value: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(value, indent=2, default=str))
        return
    if isinstance(value, dict):
        for key, item in value.items():
            print(
                f"{key}: {json.dumps(item, default=str) if isinstance(item, dict | list) else item}"
            )
    elif isinstance(value, list):
        for item in value:
            print(json.dumps(item, default=str))
    else:
        print(value)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="r3store", description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="machine-readable output")
    common = argparse.ArgumentParser(add_help=False)  # --json after the command, too
    common.add_argument("--json", action="store_true", default=argparse.SUPPRESS)
    sub = p.add_subparsers(dest="command", required=True)

    ns = sub.add_parser(
        "namespaces", parents=[common], help="list, show, create or delete namespaces"
    )
    ns_sub = ns.add_subparsers(dest="action", required=True)
    ns_sub.add_parser("list", parents=[common])
    show = ns_sub.add_parser("show", parents=[common])
    show.add_argument("name")
    create = ns_sub.add_parser("create", parents=[common])
    create.add_argument("name")
    create.add_argument("--layers", type=int, required=True)
    create.add_argument("--experts", type=int, required=True)
    create.add_argument("--top-k", type=int, required=True)
    create.add_argument("--ordered", action="store_true")
    create.add_argument("--allow-fewer", action="store_true")
    create.add_argument("--model", default="")
    delete = ns_sub.add_parser("delete", parents=[common])
    delete.add_argument("name")
    delete.add_argument("--yes", action="store_true", help="really delete")

    policy = sub.add_parser(
        "policy", parents=[common], help="set a namespace's current policy version"
    )
    policy.add_argument("name")
    policy.add_argument("--version", type=int, required=True)

    settings = sub.add_parser(
        "settings", parents=[common], help="set staleness, sampling and retention"
    )
    settings.add_argument("name")
    settings.add_argument("--max-lag", type=int)
    settings.add_argument("--max-times-sampled", type=int)
    settings.add_argument("--keep-versions", type=int)
    settings.add_argument("--ttl", type=float, help="seconds")
    settings.add_argument("--evict-after-sampled", action="store_true")

    st = sub.add_parser("stats", parents=[common], help="trajectories, bytes, per policy version")
    st.add_argument("name", nargs="?")

    maintain = sub.add_parser(
        "maintain", parents=[common], help="run retention, compaction and collection now"
    )
    maintain.add_argument(
        "--grace", type=float, default=600.0, help="seconds a retired shard stays readable"
    )
    maintain.add_argument(
        "--orphan-age",
        type=float,
        default=3600.0,
        help="seconds before an object no catalog row names is deleted",
    )

    keys = sub.add_parser("keys", parents=[common], help="create, list or revoke API keys")
    keys_sub = keys.add_subparsers(dest="action", required=True)
    make = keys_sub.add_parser("create", parents=[common])
    make.add_argument("name")
    make.add_argument("--role", choices=["writer", "reader", "admin"], required=True)
    make.add_argument("--namespace", action="append", help="repeatable; default: all")
    keys_sub.add_parser("list", parents=[common])
    revoke = keys_sub.add_parser("revoke", parents=[common])
    revoke.add_argument("name")

    rebuild = sub.add_parser(
        "rebuild", parents=[common], help="rebuild the catalog from the object store"
    )
    rebuild.add_argument("--yes", action="store_true", help="really replace the catalog")
    return p


def run(args: argparse.Namespace, settings: Settings) -> Any:
    if args.command == "rebuild":
        if not args.yes:
            raise SystemExit("rebuild replaces the catalog's content: pass --yes")
        engine = build_engine(settings)
        try:
            return engine.rebuild(_progress("rebuild")).__dict__
        finally:
            engine.close()
    engine = build_engine(settings)
    try:
        if args.command == "namespaces":
            if args.action == "list":
                return [_namespace(n) for n in engine.list_namespaces()]
            if args.action == "show":
                return _namespace(engine.namespace(args.name), engine.count(args.name))
            if args.action == "create":
                spec = RouteSpec(
                    args.layers,
                    args.experts,
                    args.top_k,
                    args.ordered,
                    args.allow_fewer,
                    args.model,
                )
                info, created = engine.create_namespace(args.name, spec)
                return {"created": created, **_namespace(info)}  # False: it existed, the same
            if not args.yes:
                raise SystemExit(f"this deletes {args.name!r} and all its routes: pass --yes")
            return {"name": args.name, "objects_deleted": engine.delete_namespace(args.name)}
        if args.command == "policy":
            return _namespace(engine.set_policy_version(args.name, args.version))
        if args.command == "settings":
            new = NamespaceSettings(
                max_policy_lag=args.max_lag,
                max_times_sampled=args.max_times_sampled,
                retention=Retention(
                    keep_versions=args.keep_versions,
                    ttl_seconds=args.ttl,
                    evict_after_sampled=args.evict_after_sampled,
                ),
            )
            return _namespace(engine.update_settings(args.name, new))
        if args.command == "stats":
            return stats(engine, args.name)
        if args.command == "keys":
            return keys(engine, args)
        maintenance = engine.maintenance(grace_seconds=args.grace, orphan_seconds=args.orphan_age)
        return maintenance.run(_progress("shards")).__dict__
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        _print(run(args, Settings()), args.json)
    except R3StoreError as exc:
        print(f"r3store: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    except ValueError as exc:
        print(f"r3store: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
