"""`r3store stats`: what each namespace holds, and with `--experts` its expert load per
source and policy version, the agreement between sources and the drift between versions."""

from __future__ import annotations

from typing import TypedDict

import numpy as np

from r3store.engine import Engine
from r3store.logic import stats as stats_lib
from r3store.policy import SOURCES
from r3store_server.cli.commands import Commands, Fields, on_engine


class VersionLoad(TypedDict):
    """Expert load of one source and policy version."""

    tokens: int
    imbalance: list[float | None]  # per layer: the busiest expert's load over the mean
    busiest: list[dict[str, float]]  # per layer: the busiest experts' shares, by expert


class VersionAgreement(TypedDict):
    """How far two sources chose the same experts, in one policy version."""

    segments: int
    overall: float | None
    per_layer: list[float | None]


class RouteStats(TypedDict):
    """`stats --experts`: what a namespace's routes say of its experts."""

    expert_load: dict[str, dict[str, VersionLoad]]  # by source, then policy version
    agreement: dict[str, dict[str, VersionAgreement]]  # by pair ("engine/trainer"), version
    drift: dict[str, list[float | None]]  # by versions ("0->1"): divergence per layer


def stats(engine: Engine, name: str | None, experts: bool = False) -> dict[str, Fields]:
    """Each namespace's usage (`NamespaceUsage`'s fields), by name; with `experts`, its
    `RouteStats` too."""
    names = [name] if name else [n.name for n in engine.namespaces.all()]
    out: dict[str, Fields] = {}
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


def route_stats(engine: Engine, ns: str, top: int = 3) -> RouteStats:
    """Expert load per source and policy version (per layer: imbalance, and the `top`
    busiest experts with their share), agreement between sources, drift."""
    analytics = engine.analytics
    loads: dict[str, dict[str, VersionLoad]] = {}
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
    agreement: dict[str, dict[str, VersionAgreement]] = {}
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


def add_commands(commands: Commands) -> None:
    """`stats [NAME] [--experts]`."""
    st = commands.add(
        "stats",
        "trajectories, bytes, per policy version",
        on_engine(lambda engine, args: stats(engine, args.name, args.experts)),
    )
    st.add_argument("name", nargs="?", help="the namespace; default: all")
    st.add_argument(
        "--experts",
        action="store_true",
        help="also expert load per policy version, agreement between route sources, drift",
    )
