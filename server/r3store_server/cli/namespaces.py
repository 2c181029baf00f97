"""`r3store namespaces` (list, show, create, delete), `policy` (a namespace's policy
version) and `settings` (its staleness, sampling, retention and lease limits: only the
options given change, `none` clears one)."""

from __future__ import annotations

import argparse
from typing import Any, NotRequired, TypedDict

from pydantic import ValidationError

from r3store.catalog_types import NamespaceInfo
from r3store.engine import Engine
from r3store.policy import MAX_POLICY_VERSION, MAX_TIMES_SAMPLED, NamespaceSettings
from r3store.spec import RouteSpec
from r3store_server.cli.arguments import CLEAR, DURATIONS, optional, seconds, whole_number
from r3store_server.cli.commands import Commands, on_engine


class NamespaceRecord(TypedDict):
    """A namespace as `namespaces`, `policy` and `settings` print it."""

    name: str
    spec: dict[str, Any]  # the RouteSpec's fields
    settings: dict[str, Any]  # the NamespaceSettings, as JSON
    policy_version: int
    created_at: float
    trajectories: NotRequired[int]  # `namespaces show`: how many it holds


class NamespaceCreated(NamespaceRecord):
    created: bool  # False: it existed, the same


class NamespaceDeleted(TypedDict):
    name: str
    objects_deleted: int


def _namespace(info: NamespaceInfo, count: int | None = None) -> NamespaceRecord:
    record: NamespaceRecord = {
        "name": info.name,
        "spec": info.spec.__dict__,
        "settings": info.settings.model_dump(mode="json"),
        "policy_version": info.policy_version,
        "created_at": info.created_at,
    }
    if count is not None:
        record["trajectories"] = count
    return record


def namespace_action(
    engine: Engine, args: argparse.Namespace
) -> NamespaceRecord | list[NamespaceRecord] | NamespaceCreated | NamespaceDeleted:
    """`namespaces list`, `show` (with its count), `create` and `delete` (with `--yes`)."""
    if args.action == "list":
        return [_namespace(n) for n in engine.namespaces.all()]
    if args.action == "show":
        return _namespace(engine.namespaces.get(args.name), engine.namespaces.count(args.name))
    if args.action == "create":
        spec = RouteSpec(
            args.layers, args.experts, args.top_k, args.ordered, args.allow_fewer, args.model
        )
        info, created = engine.namespaces.create(args.name, spec)
        made: NamespaceCreated = {"created": created, **_namespace(info)}
        return made
    if not args.yes:
        raise SystemExit(f"this deletes {args.name!r} and all its routes: pass --yes")
    return {"name": args.name, "objects_deleted": engine.namespaces.delete(args.name)}


def set_policy(engine: Engine, args: argparse.Namespace) -> NamespaceRecord:
    """`policy NAME --version N`: the namespace's current policy version."""
    return _namespace(engine.namespaces.set_policy_version(args.name, args.version))


def change_settings(engine: Engine, args: argparse.Namespace) -> NamespaceRecord:
    """`settings NAME --option value ...`: the namespace with the options given changed."""
    current = engine.namespaces.get(args.name).settings
    return _namespace(engine.namespaces.update_settings(args.name, changed(current, args)))


SETTINGS_FLAGS = {  # option: where it lives in NamespaceSettings
    "max_lag": ("max_policy_lag",),
    "max_times_sampled": ("max_times_sampled",),
    "keep_versions": ("retention", "keep_versions"),
    "ttl": ("retention", "ttl_seconds"),
    "evict_after_sampled": ("retention", "evict_after_sampled"),
    "keep_checkpoints": ("retention", "keep_checkpoints"),
    "max_open_leases": ("leasing", "max_open"),
    "max_held": ("leasing", "max_held"),
    "max_lease_seconds": ("leasing", "max_seconds"),
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
    try:
        return NamespaceSettings.model_validate(data)
    except ValidationError as exc:
        raise ValueError(_settings_error(exc)) from None


def _settings_error(exc: ValidationError) -> str:
    """Pydantic's report on settings in one line, naming the option: `--max-lag: input
    should be greater than or equal to 0 (got -3)`."""
    errors = exc.errors()
    first = errors[0]
    loc = tuple(str(part) for part in first["loc"])
    flags = [f"--{flag.replace('_', '-')}" for flag, path in SETTINGS_FLAGS.items() if path == loc]
    message = first["msg"][:1].lower() + first["msg"][1:]
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{flags[0] if flags else '.'.join(loc)}: {message} (got {first['input']!r}){more}"


def add_commands(commands: Commands) -> None:
    """`namespaces` and its actions, `policy` and `settings`."""
    ns = commands.actions(
        commands.add(
            "namespaces", "list, show, create or delete namespaces", on_engine(namespace_action)
        )
    )
    ns.add("list", "every namespace")
    show = ns.add("show", "one namespace, with its count")
    show.add_argument("name", help="the namespace")
    create = ns.add("create", "a namespace for one model's routes")
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
    delete = ns.add("delete", "a namespace and every object of it")
    delete.add_argument("name", help="the namespace")
    delete.add_argument("--yes", action="store_true", help="really delete")

    policy = commands.add(
        "policy", "set a namespace's current policy version", on_engine(set_policy)
    )
    policy.add_argument("name", help="the namespace")
    policy.add_argument("--version", type=int, required=True, help="the new policy version")

    settings = commands.add(
        "settings",
        "change staleness, sampling, retention and lease limits (only what is given; none clears)",
        on_engine(change_settings),
    )
    settings.add_argument("name", help="the namespace")
    _settings_options(settings)


def _settings_options(settings: argparse.ArgumentParser) -> None:
    """The options of `settings`, one for each of `SETTINGS_FLAGS`, in its order."""

    def count(option: str, low: int, high: int, help: str) -> None:
        """An option that is a whole number from `low` to `high`, or `none`."""
        kind = optional(whole_number(low, high))
        settings.add_argument(option, type=kind, metavar="N", help=help)

    count(
        "--max-lag",
        0,
        MAX_POLICY_VERSION,
        "serve routes at most N policy versions old (0 or more); none: no limit",
    )
    count(
        "--max-times-sampled",
        1,
        MAX_TIMES_SAMPLED,
        "sample a trajectory at most N times (1 or more); none: no limit",
    )
    count(
        "--keep-versions",
        1,
        MAX_POLICY_VERSION,
        "keep the routes of the last N policy versions (1 or more); none: all",
    )
    settings.add_argument(
        "--ttl",
        type=optional(seconds),
        metavar="DURATION",
        help=f"drop routes stored longer ago than this: {DURATIONS}; none: never",
    )
    settings.add_argument(
        "--evict-after-sampled",
        action=argparse.BooleanOptionalAction,
        help="drop a trajectory once sampled max-times-sampled times",
    )
    count(
        "--keep-checkpoints",
        1,
        MAX_TIMES_SAMPLED,
        "keep the newest N step checkpoints (1 or more; routes consumed after the oldest kept "
        "one are kept for a resume); none: every checkpoint",
    )
    count(
        "--max-open-leases",
        1,
        MAX_TIMES_SAMPLED,
        "open leases one API key holds at once (1 or more); none: no limit",
    )
    count(
        "--max-held",
        1,
        MAX_TIMES_SAMPLED,
        "trajectories one API key's open leases hold at once; none: no limit",
    )
    settings.add_argument(
        "--max-lease-seconds",
        type=seconds,
        metavar="DURATION",
        help=f"the longest a lease is taken or renewed for: {DURATIONS}",
    )
