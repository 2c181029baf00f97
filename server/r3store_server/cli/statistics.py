"""`r3store stats`: what each namespace holds, and with `--experts` its expert load per
source and policy version, the agreement between sources and the drift between versions."""

from __future__ import annotations

from typing import Any

import numpy as np

from r3store.engine import Engine
from r3store.logic import stats as stats_lib
from r3store.policy import SOURCES
from r3store_server.cli.commands import Commands, on_engine


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
