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

One module over 500 lines: each command is a short function over the engine's parts
and the argument parser that names them all; split, the parser would import every
piece back.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import re
import secrets
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import ValidationError

import r3store
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.errors import InvalidConfig, R3StoreError
from r3store.leases import MAX_STEP
from r3store.logic import stats as stats_lib
from r3store.logic.rest import REST_LEVEL
from r3store.policy import (
    MAX_POLICY_VERSION,
    MAX_TIMES_SAMPLED,
    MAX_TTL_SECONDS,
    SOURCES,
    NamespaceSettings,
)
from r3store.spec import RouteSpec
from r3store_server.auth import digest
from r3store_server.backends import bound, build_engine, migrate_catalog, sqlite_path
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
    names = [name] if name else [n.name for n in engine.namespaces.all()]
    out: dict[str, Any] = {}
    for ns in names:
        usage = engine.namespaces.usage(ns)
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


def checkpoints(engine: Engine, args: argparse.Namespace) -> Any:
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
        return consumption.resume(ns, args.step).to_dict()
    found = consumption.checkpoints(ns)
    return {
        "namespace": ns,
        "epoch": consumption.epoch(ns),
        "checkpoints": [
            {k: v for k, v in point.to_dict().items() if k != "namespace"} for point in found
        ],
    }


def leases(engine: Engine, ns: str) -> dict[str, Any]:
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


def _step(text: str) -> int:
    """An argparse type: a trainer step, a whole number from 0 to 2^63 - 1."""
    try:
        value: int | None = int(text)
    except ValueError:
        value = None
    if value is None or not 0 <= value <= MAX_STEP:
        raise argparse.ArgumentTypeError(
            f"expected a step, a whole number from 0 to 2^63 - 1; got {text!r}"
        )
    return value


def _optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind`, or `none` (the setting cleared)."""

    def parse(text: str) -> Any:
        return CLEAR if text.strip().lower() == CLEAR else kind(text)

    parse.__name__ = kind.__name__
    return parse


def _whole(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`, refused in one line."""

    def whole(text: str) -> int:
        try:
            value: int | None = int(text)
        except ValueError:
            value = None
        if value is None or not low <= value <= high:
            top = "2^63 - 1" if high == MAX_POLICY_VERSION else str(high)
            raise argparse.ArgumentTypeError(
                f"expected none or a whole number from {low} to {top}; got {text!r}"
            )
        return value

    return whole


_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")
DURATIONS = "90s, 30m, 12h, 1d, '1d 2h' or plain seconds (86400)"


def _seconds(text: str) -> float:
    """An argparse type: a duration as `_duration` shows it (`90s`, `30m`, `12h`, `1d`,
    `1d 2h`) or plain seconds, in seconds."""
    compact = "".join(text.lower().split())
    try:
        value = float(compact)
    except ValueError:
        parts = _DURATION_PART.findall(compact)
        spelled = "".join(number + unit for number, unit in parts)
        value = sum(float(n) * _UNITS[u] for n, u in parts) if parts and spelled == compact else -1
    if not (math.isfinite(value) and 0 < value <= MAX_TTL_SECONDS):
        years = MAX_TTL_SECONDS / (365.25 * 86400)
        raise argparse.ArgumentTypeError(
            f"expected none or a duration above 0 and at most {years:.0f} years: "
            f"{DURATIONS}; got {text!r}"
        )
    return value


def _duration(seconds: float) -> str:
    """`90061.5` as `1d 1h 1m 1.5s`, a form `--ttl` takes back."""
    parts, rest = [], float(seconds)
    for unit, size in _UNITS.items():
        if unit != "s" and rest >= size:
            count = int(rest // size)
            parts.append(f"{count}{unit}")
            rest -= count * size
    if rest or not parts:
        parts.append(f"{rest:g}s")
    return " ".join(parts)


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
    """JSON with `--json`; for people, `key: value` lines (nested ones indented), lists
    of records as aligned columns, expert statistics layer by layer."""
    if as_json:
        print(json.dumps(value, indent=2, default=str))
        return
    value = human(value)
    if isinstance(value, dict):
        lines = _lines(value)
    elif isinstance(value, list) and all(isinstance(item, dict) for item in value):
        if value and all("spec" in item and "settings" in item for item in value):
            value = [_namespace_row(item) for item in value]
        lines = _table(value) if value else ["none"]
    else:
        lines = [_cell(value)]
    print("\n".join(lines))


def _cell(value: Any) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return ", ".join(_cell(item) for item in value) or "none"
    if isinstance(value, dict):
        return json.dumps(value, default=str) if value else "none"
    return str(value) if value != "" else "-"


def _lines(value: dict[str, Any], indent: str = "") -> list[str]:
    lines = []
    for key, item in value.items():
        if key in _SECTIONS and isinstance(item, dict):
            title, render = _SECTIONS[key]
            lines.append(f"{indent}{title}:{'' if item else ' none'}")
            lines.extend(render(item, indent + "  "))
        elif isinstance(item, dict) and item:
            lines.append(f"{indent}{key}:")
            lines.extend(_lines(item, indent + "  "))
        elif isinstance(item, list) and item and all(isinstance(v, dict) for v in item):
            lines.append(f"{indent}{key}:")
            lines.extend(_table(item, indent + "  "))
        else:
            lines.append(f"{indent}{key}: {_cell(item)}")
    return lines


def _table(rows: list[dict[str, Any]], indent: str = "") -> list[str]:
    """Records as columns under upper-case headings, aligned."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    cells = [[str(c).upper().replace("_", "-") for c in columns]]
    cells += [[_cell(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(line[i]) for line in cells) for i in range(len(columns))]
    return [
        (indent + "  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True))).rstrip()
        for line in cells
    ]


def _namespace_row(item: dict[str, Any]) -> dict[str, Any]:
    """One line of `namespaces list`: the spec and settings most asked about."""
    spec, settings = item["spec"], item["settings"]
    top_k = str(spec["top_k"])
    top_k += " ordered" if spec.get("ordered") else ""
    top_k += " or fewer" if spec.get("allow_fewer") else ""
    retention = settings.get("retention", {})
    row = {
        "name": item["name"],
        "layers": spec["num_layers"],
        "experts": spec["num_experts"],
        "top_k": top_k,
        "policy": item["policy_version"],
        "max_lag": settings.get("max_policy_lag"),
        "keep_versions": retention.get("keep_versions"),
        "ttl": retention.get("ttl_seconds"),
    }
    if "trajectories" in item:
        row["trajectories"] = item["trajectories"]
    return {**row, "created": item["created_at"], "model": spec.get("model") or "-"}


def _fixed(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _per_layer(values: list[float | None], digits: int, indent: str, width: int = 12) -> list[str]:
    """Per-layer values, `width` a line, each line led by its layers: `layers 0-11: ...`."""
    spans = [(i, min(i + width, len(values)) - 1) for i in range(0, len(values), width)]
    labels = [f"{a}-{b}" if a != b else f"{a}" for a, b in spans]
    pad = max((len(label) for label in labels), default=0)
    return [
        f"{indent}layers {label.rjust(pad)}: "
        + " ".join(_fixed(v, digits) for v in values[a : b + 1])
        for label, (a, b) in zip(labels, spans, strict=True)
    ]


def _load_lines(loads: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for source, versions in loads.items():
        for version, held in versions.items():
            lines.append(f"{indent}{source}, policy version {version}: {held['tokens']} tokens")
            rows = [
                {
                    "layer": layer,
                    "imbalance": _fixed(imbalance, 2),
                    "busiest experts (share)": ", ".join(
                        f"{expert}: {share:.1%}" for expert, share in busiest.items()
                    ),
                }
                for layer, (imbalance, busiest) in enumerate(
                    zip(held["imbalance"], held["busiest"], strict=True)
                )
            ]
            lines.extend(_table(rows, indent + "  "))
    return lines


def _agreement_lines(agreement: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for pair, versions in agreement.items():
        for version, held in versions.items():
            lines.append(
                f"{indent}{pair}, policy version {version}: {held['segments']} segments, "
                f"overall {_fixed(held['overall'], 3)}"
            )
            lines.extend(_per_layer(held["per_layer"], 3, indent + "  "))
    return lines


def _drift_lines(drift: dict[str, Any], indent: str) -> list[str]:
    lines = []
    for step, divergence in drift.items():
        before, _, after = step.partition("->")
        lines.append(f"{indent}policy version {before} -> {after}:")
        lines.extend(_per_layer(divergence, 4, indent + "  "))
    return lines


# `stats --experts` for people: the key, its title, and how its lines are made
_SECTIONS: dict[str, tuple[str, Callable[[dict[str, Any], str], list[str]]]] = {
    "expert_load": ("expert load (imbalance: busiest expert over the mean)", _load_lines),
    "agreement": ("agreement between sources (share of experts both chose)", _agreement_lines),
    "drift": ("drift (Jensen-Shannon divergence from the previous version)", _drift_lines),
}


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
        help="change staleness, sampling, retention and lease limits (only what is given; "
        "none clears)",
    )
    settings.add_argument("name", help="the namespace")
    settings.add_argument(
        "--max-lag",
        type=_optional(_whole(0, MAX_POLICY_VERSION)),
        metavar="N",
        help="serve routes at most N policy versions old (0 or more); none: no limit",
    )
    settings.add_argument(
        "--max-times-sampled",
        type=_optional(_whole(1, MAX_TIMES_SAMPLED)),
        metavar="N",
        help="sample a trajectory at most N times (1 or more); none: no limit",
    )
    settings.add_argument(
        "--keep-versions",
        type=_optional(_whole(1, MAX_POLICY_VERSION)),
        metavar="N",
        help="keep the routes of the last N policy versions (1 or more); none: all",
    )
    settings.add_argument(
        "--ttl",
        type=_optional(_seconds),
        metavar="DURATION",
        help=f"drop routes stored longer ago than this: {DURATIONS}; none: never",
    )
    settings.add_argument(
        "--evict-after-sampled",
        action=argparse.BooleanOptionalAction,
        help="drop a trajectory once sampled max-times-sampled times",
    )
    settings.add_argument(
        "--keep-checkpoints",
        type=_optional(_whole(1, MAX_TIMES_SAMPLED)),
        metavar="N",
        help="keep the newest N step checkpoints (1 or more; routes consumed after the "
        "oldest kept one are kept for a resume); none: every checkpoint",
    )
    settings.add_argument(
        "--max-open-leases",
        type=_optional(_whole(1, MAX_TIMES_SAMPLED)),
        metavar="N",
        help="open leases one API key holds at once (1 or more); none: no limit",
    )
    settings.add_argument(
        "--max-held",
        type=_optional(_whole(1, MAX_TIMES_SAMPLED)),
        metavar="N",
        help="trajectories one API key's open leases hold at once; none: no limit",
    )
    settings.add_argument(
        "--max-lease-seconds",
        type=_seconds,
        metavar="DURATION",
        help=f"the longest a lease is taken or renewed for: {DURATIONS}",
    )

    cps = sub.add_parser(
        "checkpoints", parents=[common], help="list, delete or resume from step checkpoints"
    )
    cps_sub = cps.add_subparsers(dest="action", required=True, metavar="ACTION")
    cps_list = cps_sub.add_parser(
        "list", parents=[common], help="a namespace's checkpoints by step, and its epoch"
    )
    cps_list.add_argument("name", help="the namespace")
    cps_delete = cps_sub.add_parser(
        "delete",
        parents=[common],
        help="forget a checkpoint (routes only it kept become retention's again)",
    )
    cps_resume = cps_sub.add_parser(
        "resume",
        parents=[common],
        help="return a namespace's consumption to a checkpoint: undo what was committed "
        "after it, fence open leases, drop later checkpoints, start a new epoch",
    )
    for action in (cps_delete, cps_resume):
        action.add_argument("name", help="the namespace")
        action.add_argument("step", type=_step, help="the checkpoint's trainer step")
    cps_resume.add_argument("--yes", action="store_true", help="really resume")

    held = sub.add_parser(
        "leases", parents=[common], help="a namespace's open leases: holder, size, expiry"
    )
    held.add_argument("name", help="the namespace")

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
        "--dry-run",
        action="store_true",
        help="show what a pass would drop, rewrite and delete, changing nothing",
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
        choices=["writer", "reader", "trainer", "admin"],
        required=True,
        help="writer: upload; reader: read, sample and lease; trainer: a reader that also "
        "sets the policy version and records and resumes from step checkpoints; admin: "
        "everything",
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

    migrate = sub.add_parser(
        "migrate",
        parents=[common],
        help="upgrade the catalog's schema to this version's (servers do it when they open it)",
    )
    migrate.add_argument(
        "--dry-run", action="store_true", help="print the current and target revision only"
    )
    return p


def migrate(settings: Settings, dry_run: bool) -> dict[str, Any]:
    """`r3store migrate`: the catalog's schema revision and the newest, and the upgrade
    (none with `--dry-run`). Needs no store; refuses to make a new SQLite catalog."""
    catalog_file = sqlite_path(settings)
    if catalog_file is not None and not catalog_file.exists():
        raise InvalidConfig(
            f"no catalog at {catalog_file} (R3STORE_CATALOG_URL, or R3STORE_DATA_DIR): point "
            "the settings at the server's catalog"
        )
    return migrate_catalog(settings, dry_run)


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
    if catalog_file is not None and not catalog_file.exists() and not init:
        raise InvalidConfig(
            f"no catalog at {catalog_file} (R3STORE_CATALOG_URL, or R3STORE_DATA_DIR): point "
            "the settings at the server's catalog, or pass --init to create a new, empty one"
        )
    engine = build_engine(settings)
    print(
        f"r3store: store {engine.store_description}, catalog {settings.catalog_description()}",
        file=sys.stderr,
    )
    return bound(engine, settings, init) if bind else engine


def maintain(engine: Engine, args: argparse.Namespace) -> Any:
    """One maintenance pass now, or with `--dry-run` what one would do."""
    maintenance = engine.upkeep.maintenance(
        MaintenanceOptions(
            grace_seconds=args.grace,
            orphan_seconds=args.orphan_age,
            cold_seconds=args.cold_age,
            rest_level=args.rest_level,
        )
    )
    if not args.dry_run:
        return maintenance.run(_progress("shards")).__dict__
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


def run(args: argparse.Namespace, settings: Settings) -> Any:
    if args.command == "migrate":
        return migrate(settings, args.dry_run)
    if args.command == "rebuild" and not args.yes:
        raise SystemExit("rebuild replaces the catalog's content: pass --yes")
    engine = open_engine(settings, args.init, bind=args.command != "rebuild")
    try:
        if args.command == "rebuild":
            return engine.upkeep.rebuild(_progress("rebuild")).__dict__
        if args.command == "namespaces":
            if args.action == "list":
                return [_namespace(n) for n in engine.namespaces.all()]
            if args.action == "show":
                return _namespace(
                    engine.namespaces.get(args.name), engine.namespaces.count(args.name)
                )
            if args.action == "create":
                spec = RouteSpec(
                    args.layers,
                    args.experts,
                    args.top_k,
                    args.ordered,
                    args.allow_fewer,
                    args.model,
                )
                info, created = engine.namespaces.create(args.name, spec)
                return {"created": created, **_namespace(info)}  # False: it existed, the same
            if not args.yes:
                raise SystemExit(f"this deletes {args.name!r} and all its routes: pass --yes")
            return {"name": args.name, "objects_deleted": engine.namespaces.delete(args.name)}
        if args.command == "policy":
            return _namespace(engine.namespaces.set_policy_version(args.name, args.version))
        if args.command == "settings":
            current = engine.namespaces.get(args.name).settings
            return _namespace(engine.namespaces.update_settings(args.name, changed(current, args)))
        if args.command == "stats":
            return stats(engine, args.name, args.experts)
        if args.command == "keys":
            return keys(engine, args)
        if args.command == "checkpoints":
            return checkpoints(engine, args)
        if args.command == "leases":
            return leases(engine, args.name)
        return maintain(engine, args)
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
