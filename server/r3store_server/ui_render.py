"""The status page as HTML and SVG, from plain values: no I/O, no script, no asset from
anywhere else. `ui.py` gathers the values and serves the pages."""

from __future__ import annotations

import html
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from r3store.analytics import VersionAgreement, VersionDrift, VersionLoad
from r3store.catalog_types import NamespaceInfo, NamespaceUsage

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1b1b;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td.name,th.name{text-align:left}
.muted{color:#666}.maps{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;background:#fff;border:1px solid #ddd;padding:6px}
figcaption{font-size:12px;color:#444}
"""


@dataclass(frozen=True)
class NamespaceRow:
    info: NamespaceInfo
    usage: NamespaceUsage


@dataclass(frozen=True)
class NamespaceDetail:
    row: NamespaceRow
    loads: dict[str, list[VersionLoad]]  # by source
    agreements: dict[tuple[str, str], list[VersionAgreement]]
    drift: list[VersionDrift]  # of the engine routes


@dataclass(frozen=True)
class Activity:
    """Retention and compaction since the server started (None: maintenance is off)."""

    totals: dict[str, int] = field(default_factory=dict)


def _e(value: object) -> str:
    return html.escape(str(value), quote=True)


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{n} B"


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{_e(title)}</title><style>{_STYLE}</style></head><body>{body}</body></html>"
    )


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], css: str = "") -> str:
    cells = "".join(f"<th{' class=name' if i == 0 else ''}>{h}</th>" for i, h in enumerate(head))
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=name' if i == 0 else ''}>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table class='{css}'><tr>{cells}</tr>{body}</table>"


def overview(rows: Sequence[NamespaceRow], activity: Activity | None, version: str) -> str:
    """The front page: every namespace the key may read, and maintenance activity."""
    table = _table(
        [
            "namespace",
            "trajectories",
            "shards",
            "stored",
            "dead",
            "policy version",
            "versions held",
            "max lag",
            "samplings",
            "sampled",
        ],
        [
            [
                f"<a href='/ui/namespaces/{_e(r.info.name)}'>{_e(r.info.name)}</a>",
                str(r.usage.trajectories),
                str(r.usage.shards),
                _bytes(r.usage.shard_bytes),
                _bytes(r.usage.dead_route_bytes),
                str(r.info.policy_version),
                _versions(r.usage.by_policy_version),
                "none"
                if r.info.settings.max_policy_lag is None
                else str(r.info.settings.max_policy_lag),
                str(r.usage.samplings),
                str(r.usage.sampled),
            ]
            for r in rows
        ],
        "namespaces",
    )
    body = (
        f"<h1>r3store</h1><div class=muted>version {_e(version)} · "
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}</div><h2>Namespaces</h2>"
        + (table if rows else "<p>No namespace yet.</p>")
        + _activity(activity)
    )
    return _page("r3store", body)


def _versions(counts: dict[int, int]) -> str:
    if not counts:
        return "-"
    low, high = min(counts), max(counts)
    return str(low) if low == high else f"{low}-{high}"


def _activity(activity: Activity | None) -> str:
    if activity is None:
        return "<h2>Retention and compaction</h2><p class=muted>Maintenance is off.</p>"
    labels = {
        "trajectories_dropped": "trajectories dropped by retention",
        "shards_compacted": "shards compacted",
        "objects_deleted": "objects deleted",
        "orphans_deleted": "orphaned uploads deleted",
        "tombstones_deleted": "tombstones deleted",
        "live_bytes": "live route bytes",
        "dead_bytes": "dead route bytes",
    }
    rows = [[labels[k], str(activity.totals.get(k, 0))] for k in labels]
    return "<h2>Retention and compaction (since start)</h2>" + _table(
        ["", "count"], rows, "activity"
    )


def _shade(fraction: float) -> str:
    """White (0) to dark blue (1)."""
    f = min(1.0, max(0.0, fraction))
    r, g, b = round(255 - 225 * f), round(255 - 185 * f), round(255 - 95 * f)
    return f"#{r:02x}{g:02x}{b:02x}"


def heatmap(load: VersionLoad, source: str, cell: int = 6) -> str:
    """One policy version's `[L, E]` load: a row per layer, a column per expert, darker
    for a larger share of the layer's busiest expert."""
    layers, experts = load.load.shape
    rects = []
    for layer in range(layers):
        row = load.load[layer]
        top = int(row.max()) or 1
        for expert in range(experts):
            count = int(row[expert])
            rects.append(
                f"<rect class=cell x={expert * cell} y={layer * cell} width={cell} "
                f"height={cell} fill='{_shade(count / top)}' data-layer={layer} "
                f"data-expert={expert} data-count={count}></rect>"
            )
    width, height = experts * cell, layers * cell
    return (
        f"<figure><svg class=heatmap xmlns='http://www.w3.org/2000/svg' width={width} "
        f"height={height} data-version={load.policy_version} data-source={_e(source)} "
        f"data-layers={layers} data-experts={experts}>{''.join(rects)}</svg>"
        f"<figcaption>policy version {load.policy_version} · {load.tokens} tokens · "
        f"layers down, experts across</figcaption></figure>"
    )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _agreement(pair: tuple[str, str], held: list[VersionAgreement]) -> str:
    layers = len(held[0].overlap.matches) if held else 0
    rows = [
        [str(v.policy_version), str(v.segments), _percent(v.overlap.overall)]
        + [
            f"<span data-layer={i} data-agreement={'' if f is None else f'{f:.6f}'}>"
            f"{_percent(f)}</span>"
            for i, f in enumerate(v.overlap.fraction)
        ]
        for v in held
    ]
    head = ["policy version", "segments", "all layers"] + [f"L{i}" for i in range(layers)]
    title = f"<h3>{_e(pair[0])} vs {_e(pair[1])}</h3>"
    return title + _table(head, rows, f"agreement {_e(pair[0])}-{_e(pair[1])}")


def _drift(steps: list[VersionDrift]) -> str:
    if not steps:
        return "<p class=muted>Fewer than two policy versions hold routes.</p>"
    layers = len(steps[0].divergence)
    rows = [
        [f"{d.before} → {d.after}"] + ["-" if x is None else f"{x:.4f}" for x in d.divergence]
        for d in steps
    ]
    return _table(["versions"] + [f"L{i}" for i in range(layers)], rows, "drift")


def namespace_page(detail: NamespaceDetail, last: int) -> str:
    """One namespace: its figures, expert-load heatmaps of its last `last` policy
    versions per source, agreement between sources, drift across versions."""
    info, usage = detail.row.info, detail.row.usage
    spec = info.spec
    facts = _table(
        ["", ""],
        [
            [
                "route spec",
                f"{spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k}",
            ],
            ["trajectories", str(usage.trajectories)],
            ["shards", f"{usage.shards} ({_bytes(usage.shard_bytes)})"],
            [
                "live / dead route bytes",
                f"{_bytes(usage.live_route_bytes)} / {_bytes(usage.dead_route_bytes)}",
            ],
            ["policy version", str(info.policy_version)],
            ["max policy lag", str(info.settings.max_policy_lag)],
            ["max times sampled", str(info.settings.max_times_sampled)],
            ["samplings / sampled", f"{usage.samplings} / {usage.sampled}"],
            ["read sources", ", ".join(info.settings.read_sources)],
        ],
        "facts",
    )
    maps = []
    for source, loads in detail.loads.items():
        if loads:
            shown = loads[-last:]
            maps.append(
                f"<h3>{_e(source)} routes</h3><div class=maps>"
                + "".join(heatmap(v, source) for v in shown)
                + "</div>"
            )
    agreements = [_agreement(pair, held) for pair, held in detail.agreements.items() if held]
    body = (
        f"<p><a href='/ui'>all namespaces</a></p><h1>{_e(info.name)}</h1>{facts}"
        "<h2>Expert load per policy version</h2>"
        + ("".join(maps) or "<p class=muted>No routes counted yet.</p>")
        + "<h2>Agreement between route sources</h2>"
        + ("".join(agreements) or "<p class=muted>No trajectory holds two sources yet.</p>")
        + "<h2>Router drift (engine routes)</h2>"
        + _drift(detail.drift)
    )
    return _page(f"r3store · {info.name}", body)


def login_page(message: str) -> str:
    """What a browser without a key gets: a form that keeps the key in a cookie."""
    body = (
        f"<h1>r3store</h1><p>{_e(message)}</p>"
        "<form method=post action='/ui/login'><label>API key "
        "<input type=password name=key autocomplete=off></label> "
        "<button type=submit>Open</button></form>"
    )
    return _page("r3store", body)
