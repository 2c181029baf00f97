"""`r3store`: the operator's command line, working on the store and catalog directly.

It finds the store as the server does (the same `R3STORE_*` settings: by default the
embedded store in `./data`), says on stderr which one it opened, and refuses to make a
new, empty embedded store unless asked (`--init`).

    r3store namespaces list
    r3store namespaces create run1 --layers 48 --experts 128 --top-k 8
    r3store policy run1 --version 12
    r3store settings run1 --max-lag 2 --keep-versions 4 --ttl 86400
    r3store settings run1 --max-lag none     # only what is given changes; none clears
    r3store stats [run1]
    r3store stats run1 --experts  # expert load, agreement between sources, drift
    r3store maintain            # retention, compaction and collection, now
    r3store keys create trainer --role reader --namespace run1   # shows the key once
    r3store keys revoke trainer
    r3store rebuild --yes       # the catalog again, from the object store alone

Every command takes `--json` for scripts. Long operations show progress on stderr when
it is a terminal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import r3store
from r3store import stats as stats_lib
from r3store.engine import Engine
from r3store.errors import InvalidConfig, R3StoreError
from r3store.policy import SOURCES, NamespaceSettings
from r3store.rest import REST_LEVEL
from r3store.spec import RouteSpec
from r3store_server.auth import digest
from r3store_server.backends import build_engine
from r3store_server.settings import Settings, load_settings, unknown_variables

CLEAR = "none"


def _progress(label: str) -> Callable[[int, int], None] | None:
    """A progress bar on stderr, or None when stderr is not a terminal."""
    if not sys.stderr.isatty():
        return None
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


def stats(engine: Engine, name: str | None, experts: bool = False) -> dict[str, Any]:
    names = [name] if name else [n.name for n in engine.list_namespaces()]
    out: dict[str, Any] = {}
    for ns in names:
        usage = engine.usage(ns)
        out[ns] = {
            **usage.__dict__,
            "by_policy_version": {str(v): n for v, n in usage.by_policy_version.items()},
        }
        if experts:
            out[ns].update(route_stats(engine, ns))
    return out


def _rounded(values: list[float | None]) -> list[float | None]:
    return [None if v is None else round(v, 4) for v in values]


def route_stats(engine: Engine, ns: str, top: int = 3) -> dict[str, Any]:
    """Expert load per source and policy version (per layer: imbalance, and the `top`
    busiest experts with their share), agreement between sources, drift."""
    analytics = engine.analytics
    loads: dict[str, Any] = {}
    for source in SOURCES:
        for v in analytics.loads(ns, source):
            layers = []
            for row in v.load:
                total = int(row.sum()) or 1
                busiest = [int(e) for e in np.argsort(-row, kind="stable")[:top]]
                layers.append({str(e): round(int(row[e]) / total, 4) for e in busiest})
            loads.setdefault(source, {})[str(v.policy_version)] = {
                "tokens": v.tokens,
                "imbalance": _rounded(stats_lib.imbalance(v.load)),
                "busiest": layers,
            }
    agreement: dict[str, Any] = {}
    for i, a in enumerate(SOURCES):
        for b in SOURCES[i + 1 :]:
            for held in analytics.agreement(ns, a, b):
                overall = held.overlap.overall
                agreement.setdefault(f"{a}/{b}", {})[str(held.policy_version)] = {
                    "segments": held.segments,
                    "overall": None if overall is None else round(overall, 4),
                    "per_layer": _rounded(held.overlap.fraction),
                }
    drift = {f"{d.before}->{d.after}": _rounded(d.divergence) for d in analytics.drift(ns)}
    return {"expert_load": loads, "agreement": agreement, "drift": drift}


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


SETTINGS_FLAGS = {  # option: where it lives in NamespaceSettings
    "max_lag": ("max_policy_lag",),
    "max_times_sampled": ("max_times_sampled",),
    "keep_versions": ("retention", "keep_versions"),
    "ttl": ("retention", "ttl_seconds"),
    "evict_after_sampled": ("retention", "evict_after_sampled"),
}


def changed(current: NamespaceSettings, args: argparse.Namespace) -> NamespaceSettings:
    """`current` with the options that were given (`none`: cleared); the others kept."""
    data = current.model_dump()
    for flag, path in SETTINGS_FLAGS.items():
        value = getattr(args, flag)
        if value is None:
            continue
        target = data
        for part in path[:-1]:
            target = target[part]
        target[path[-1]] = None if value == CLEAR else value
    return NamespaceSettings.model_validate(data)


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        return CLEAR if text.lower() == CLEAR else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _duration(seconds: float) -> str:
    parts, rest = [], int(seconds)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60), ("s", 1)):
        if rest >= size:
            parts.append(f"{rest // size}{unit}")
            rest %= size
    return " ".join(parts) or f"{seconds:g}s"


def human(value: Any, key: str = "") -> Any:
    """`value` for people: times as UTC dates, durations in days, hours and minutes."""
    if isinstance(value, dict):
        return {k: human(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [human(v) for v in value]
    if isinstance(value, int | float) and not isinstance(value, bool):
        if key.endswith("_at") and value > 0:
            stamp = datetime.datetime.fromtimestamp(value, datetime.UTC)
            return stamp.strftime("%Y-%m-%d %H:%M:%S UTC")
        if key.endswith("seconds") or key in ("grace", "orphan_age"):
            return _duration(value)
    return value


def _print(value: Any, as_json: bool) -> None:
    if as_json:
        print(json.dumps(value, indent=2, default=str))
        return
    value = human(value)
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
        help="create the embedded store if R3STORE_DATA_DIR does not exist yet",
    )
    common = argparse.ArgumentParser(add_help=False)  # --json after the command, too
    common.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ns = sub.add_parser(
        "namespaces", parents=[common], help="list, show, create or delete namespaces"
    )
    ns_sub = ns.add_subparsers(dest="action", required=True, metavar="ACTION")
    ns_sub.add_parser("list", parents=[common], help="every namespace")
    show = ns_sub.add_parser("show", parents=[common], help="one namespace, with its count")
    show.add_argument("name", help="the namespace")
    create = ns_sub.add_parser(
        "create", parents=[common], help="a namespace for one model's routes"
    )
    create.add_argument("name", help="the namespace (letters, digits, . _ -)")
    create.add_argument("--layers", type=int, required=True, help="MoE layers of the model")
    create.add_argument("--experts", type=int, required=True, help="routed experts per layer")
    create.add_argument("--top-k", type=int, required=True, help="experts chosen per token")
    create.add_argument(
        "--ordered", action="store_true", help="keep the order of each token's experts"
    )
    create.add_argument(
        "--allow-fewer", action="store_true", help="accept fewer than top-k experts per token"
    )
    create.add_argument("--model", default="", help="the model's name, for people")
    delete = ns_sub.add_parser(
        "delete", parents=[common], help="a namespace and every object of it"
    )
    delete.add_argument("name", help="the namespace")
    delete.add_argument("--yes", action="store_true", help="really delete")

    policy = sub.add_parser(
        "policy", parents=[common], help="set a namespace's current policy version"
    )
    policy.add_argument("name", help="the namespace")
    policy.add_argument("--version", type=int, required=True, help="the new policy version")

    settings = sub.add_parser(
        "settings",
        parents=[common],
        help="change staleness, sampling and retention (only what is given; none clears)",
    )
    settings.add_argument("name", help="the namespace")
    settings.add_argument(
        "--max-lag",
        type=_optional(int),
        help="serve routes at most this many policy versions old; none: no limit",
    )
    settings.add_argument(
        "--max-times-sampled",
        type=_optional(int),
        help="sample a trajectory at most this often; none: no limit",
    )
    settings.add_argument(
        "--keep-versions",
        type=_optional(int),
        help="keep the routes of the last N policy versions; none: all",
    )
    settings.add_argument(
        "--ttl", type=_optional(float), help="drop routes older than this many seconds; none: never"
    )
    settings.add_argument(
        "--evict-after-sampled",
        action=argparse.BooleanOptionalAction,
        help="drop a trajectory once sampled max-times-sampled times",
    )

    st = sub.add_parser("stats", parents=[common], help="trajectories, bytes, per policy version")
    st.add_argument("name", nargs="?", help="the namespace; default: all")
    st.add_argument(
        "--experts",
        action="store_true",
        help="also expert load per policy version, agreement between route sources, drift",
    )

    maintain = sub.add_parser(
        "maintain",
        parents=[common],
        help="run retention, compaction, compression at rest and collection now",
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
    maintain.add_argument(
        "--cold-age",
        type=float,
        default=600.0,
        help="seconds after which shards are merged and compressed again at rest",
    )
    maintain.add_argument(
        "--rest-level",
        type=int,
        choices=range(1, 23),
        default=REST_LEVEL,
        metavar="1-22",
        help="the zstd level of rows compressed again at rest",
    )

    keys = sub.add_parser("keys", parents=[common], help="create, list or revoke API keys")
    keys_sub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    make = keys_sub.add_parser(
        "create",
        parents=[common],
        help="a new key, shown once (turns authentication on, within 5 s, on a server "
        "that had none)",
    )
    make.add_argument("name", help="who the key is for")
    make.add_argument(
        "--role",
        choices=["writer", "reader", "admin"],
        required=True,
        help="writer: upload; reader: read and sample; admin: everything",
    )
    make.add_argument(
        "--namespace", action="append", help="a namespace it may use (repeatable); default: all"
    )
    keys_sub.add_parser("list", parents=[common], help="every key, without the keys themselves")
    revoke = keys_sub.add_parser("revoke", parents=[common], help="revoke a key (within 5 s)")
    revoke.add_argument("name", help="the key's name")

    rebuild = sub.add_parser(
        "rebuild", parents=[common], help="rebuild the catalog from the object store"
    )
    rebuild.add_argument("--yes", action="store_true", help="really replace the catalog")
    return p


def open_engine(settings: Settings, init: bool) -> Engine:
    """The engine the settings name; refuses to make a new embedded store unless `init`."""
    if settings.store == "local" and not settings.data_dir.exists() and not init:
        raise InvalidConfig(
            f"no store at {settings.data_dir.resolve()} (R3STORE_DATA_DIR): run r3store "
            "where the server keeps its data, set R3STORE_DATA_DIR (or R3STORE_STORE=s3 and "
            "R3STORE_S3__*), or pass --init to create a new, empty store there"
        )
    engine = build_engine(settings)
    print(
        f"r3store: store {engine.store_description}, catalog {settings.catalog_description()}",
        file=sys.stderr,
    )
    return engine


def run(args: argparse.Namespace, settings: Settings) -> Any:
    if args.command == "rebuild" and not args.yes:
        raise SystemExit("rebuild replaces the catalog's content: pass --yes")
    engine = open_engine(settings, args.init)
    try:
        if args.command == "rebuild":
            return engine.rebuild(_progress("rebuild")).__dict__
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
            current = engine.namespace(args.name).settings
            return _namespace(engine.update_settings(args.name, changed(current, args)))
        if args.command == "stats":
            return stats(engine, args.name, args.experts)
        if args.command == "keys":
            return keys(engine, args)
        maintenance = engine.maintenance(
            grace_seconds=args.grace,
            orphan_seconds=args.orphan_age,
            cold_seconds=args.cold_age,
            rest_level=args.rest_level,
        )
        return maintenance.run(_progress("shards")).__dict__
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = load_settings()
        for name in unknown_variables():
            print(f"r3store: warning: {name} is not a setting (a typo?)", file=sys.stderr)
        _print(run(args, settings), args.json)
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


if __name__ == "__main__":
    raise SystemExit(main())
