"""The status page as HTML and SVG, from plain values: no I/O, no script, no asset from
anywhere else. `ui.py` gathers the values and serves the pages."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from r3store.catalog_types import NamespaceInfo, NamespaceUsage
from r3store.engine.analytics import VersionAgreement, VersionDrift, VersionLoad
from r3store.leases import Checkpoint, Lease
from r3store.logic import stats
from r3store.policy import Retention
from r3store_server.ui_charts import (
    PALETTE,
    STYLE,
    Bar,
    Point,
    Series,
    bar_chart,
    colour_scale,
    e,
    heatmap,
    line_chart,
    percent,
    plain,
    ratio,
    scale_top,
)

_STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:24px;color:#1b1b1b;background:#fafafa}
h1{font-size:20px;margin:0 0 4px}h2{font-size:16px;margin:28px 0 8px}
h3{font-size:14px;margin:16px 0 6px}
table{border-collapse:collapse;background:#fff}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:right}
th{background:#f0f0f0}td.name,th.name{text-align:left}
.muted{color:#666}.maps{display:flex;flex-wrap:wrap;gap:16px}
figure{margin:0;background:#fff;border:1px solid #ddd;padding:6px}
figcaption{font-size:12px;color:#444}.scroll{overflow-x:auto;max-width:100%}
p.note{max-width:60em}code{background:#eee;padding:0 3px;white-space:nowrap}
form.out{float:right}
"""
# ends the login form's session (the browser forgets its cookie)
SIGN_OUT = (
    "<form class=out method=post action='/ui/logout'><button type=submit>Sign out</button></form>"
)


@dataclass(frozen=True)
class NamespaceRow:
    info: NamespaceInfo
    usage: NamespaceUsage


@dataclass(frozen=True)
class Consumption:
    """A namespace's consumption by trainers: its epoch, step checkpoints (by step) and
    open leases (oldest first), as of `now`."""

    epoch: int = 0
    checkpoints: Sequence[Checkpoint] = ()
    leases: Sequence[Lease] = ()
    now: float = 0.0


@dataclass(frozen=True)
class NamespaceDetail:
    row: NamespaceRow
    loads: dict[str, list[VersionLoad]]  # by source
    agreements: dict[tuple[str, str], list[VersionAgreement]]
    drift: dict[str, list[VersionDrift]]  # by source
    consumption: Consumption = field(default_factory=Consumption)


@dataclass(frozen=True)
class Activity:
    """Retention and compaction since the server started (None: maintenance is off)."""

    totals: dict[str, int] = field(default_factory=dict)


_e = e


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
        f"<title>{_e(title)}</title><style>{_STYLE}{STYLE}</style></head><body>{body}</body></html>"
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
        f"{SIGN_OUT}<h1>r3store</h1><div class=muted>version {_e(version)} · "
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
        "trajectories_kept": "trajectories retention kept for a lease or a checkpoint",
        "leases_forgotten": "closed leases forgotten",
        "shards_compacted": "shards compacted",
        "objects_deleted": "objects deleted",
        "orphans_deleted": "orphaned uploads deleted",
        "tombstones_deleted": "tombstones deleted",
        "live_bytes": "live route bytes",
        "dead_bytes": "dead route bytes",
    }
    rows = [
        [labels[k], _bytes(n) if k.endswith("_bytes") else str(n)]
        for k in labels
        for n in [activity.totals.get(k, 0)]
    ]
    return "<h2>Retention and compaction (since start)</h2>" + _table(
        ["", "count"], rows, "activity"
    )


def _percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def _or_none(value: object, none: str = "none") -> str:
    return none if value is None else str(value)


def _duration(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= size:
            return f"{seconds / size:.3g} {unit}"
    return f"{seconds:g} s"


def _retention(retention: Retention) -> str:
    parts = []
    if retention.keep_versions is not None:
        parts.append(f"the last {retention.keep_versions} policy versions")
    if retention.ttl_seconds is not None:
        parts.append(f"for {_duration(retention.ttl_seconds)}")
    if retention.evict_after_sampled:
        parts.append("until sampled the most times allowed")
    return "keeps " + ", ".join(parts) if parts else "keeps everything (never drops)"


def _kept_checkpoints(retention: Retention) -> str:
    if retention.keep_checkpoints is None:
        return "every one"
    return f"the newest {retention.keep_checkpoints}"


def _remaining(seconds: float) -> str:
    """A time left, in its two largest units: `2 h 5 min`, `9 min 58 s`, `45 s`."""
    left = max(int(seconds), 0)
    parts = [(left // 86400, "d"), (left % 86400 // 3600, "h"), (left % 3600 // 60, "min")]
    parts.append((left % 60, "s"))
    shown = [f"{n} {unit}" for n, unit in parts if n]
    return " ".join(shown[:2]) or "0 s"


def _when(stamp: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(stamp))


def _consumption(held: Consumption) -> str:
    """The trainer's checkpoints and open leases."""
    points = (
        _table(
            ["step", "consumed", "policy version", "epoch", "when"],
            [
                [
                    str(c.step),
                    str(c.consumed),
                    str(c.policy_version),
                    str(c.epoch),
                    _when(c.created_at),
                ]
                for c in held.checkpoints
            ],
            "checkpoints",
        )
        if held.checkpoints
        else "<p class=muted>No checkpoint.</p>"
    )
    leases = (
        _table(
            ["lease", "holder", "trajectories", "expires in"],
            [
                [
                    f"<code title='{_e(lease.lease_id)}'>{_e(lease.lease_id[:8])}</code>",
                    _e(lease.holder or "-"),
                    str(len(lease.trajectory_ids)),
                    _remaining(lease.expires_at - held.now),
                ]
                for lease in held.leases
            ],
            "leases",
        )
        if held.leases
        else "<p class=muted>No open lease.</p>"
    )
    return (
        f"<p>Epoch {held.epoch} (one more at each resume).</p>"
        f"<h3>Checkpoints</h3>{points}<h3>Open leases</h3>{leases}"
    )


def _recent(rows: list[list[str]], shown: int, what: str) -> str:
    if len(rows) <= shown:
        return ""
    return f"<p class=muted>The last {shown} of {len(rows)} {what}; the chart shows all.</p>"


TABLE_ROWS = 12  # versions a table lists; the charts show all


def _pairs(detail: NamespaceDetail) -> list[tuple[tuple[str, str], list[VersionAgreement]]]:
    return [(pair, held) for pair, held in detail.agreements.items() if held]


def _lowest(v: VersionAgreement) -> tuple[int, float] | None:
    held = [(f, i) for i, f in enumerate(v.overlap.fraction) if f is not None]
    if not held:
        return None
    value, layer = min(held)
    return layer, value


def _agreement_chart(pairs: list[tuple[tuple[str, str], list[VersionAgreement]]]) -> str:
    series = []
    for i, ((a, b), held) in enumerate(pairs):
        colour, name = PALETTE[i % len(PALETTE)], f"{a} vs {b}"
        overall: list[Point] = []
        lowest: list[Point] = []
        for v in held:
            at = f"{name}, policy version {v.policy_version}"
            value = v.overlap.overall
            overall.append(
                (
                    v.policy_version,
                    value,
                    f"{at}: {_percent(value)} of the chosen experts agree over all layers "
                    f"({v.segments} segments, {v.tokens} tokens)",
                )
            )
            low = _lowest(v)
            lowest.append(
                (v.policy_version, None, "")
                if low is None
                else (
                    v.policy_version,
                    low[1],
                    f"{at}: lowest is layer {low[0]}, {percent(low[1])}",
                )
            )
        series.append(Series(f"{name}, all layers", overall, colour))
        series.append(Series(f"{name}, lowest layer", lowest, colour, dashed=True))
    return line_chart(
        "Agreement between route sources over policy versions",
        series,
        "experts both sources chose",
        "%",
        "agreement-chart",
        cap=1.0,
    )


def _agreement_table(pair: tuple[str, str], held: list[VersionAgreement]) -> str:
    layers = len(held[0].overlap.matches) if held else 0
    rows = [
        [str(v.policy_version), str(v.segments), str(v.tokens), _percent(v.overlap.overall)]
        + [
            f"<span data-layer={i} data-agreement={'' if f is None else f'{f:.6f}'}>"
            f"{_percent(f)}</span>"
            for i, f in enumerate(v.overlap.fraction)
        ]
        for v in held
    ]
    head = ["policy version", "segments", "tokens", "all layers"] + [f"L{i}" for i in range(layers)]
    title = f"<h3>{_e(pair[0])} vs {_e(pair[1])}, per layer</h3>"
    table = _table(head, rows[-TABLE_ROWS:], f"agreement {_e(pair[0])}-{_e(pair[1])}")
    return title + _recent(rows, TABLE_ROWS, "policy versions") + f"<div class=scroll>{table}</div>"


def _drift_chart(drift: dict[str, list[VersionDrift]]) -> str:
    series = []
    for i, (source, steps) in enumerate(drift.items()):
        colour = PALETTE[i % len(PALETTE)]
        mean: list[Point] = []
        top: list[Point] = []
        for d in steps:
            at = f"{source} routes, policy version {d.before} → {d.after}"
            held = [x for x in d.divergence if x is not None]
            if not held:
                mean.append((d.after, None, ""))
                top.append((d.after, None, ""))
                continue
            average, layer = sum(held) / len(held), d.divergence.index(max(held))
            mean.append((d.after, average, f"{at}: mean over layers {plain(average)}"))
            top.append((d.after, max(held), f"{at}: most in layer {layer}, {plain(max(held))}"))
        series.append(Series(f"{source}, mean over layers", mean, colour))
        series.append(Series(f"{source}, most drifting layer", top, colour, dashed=True))
    return line_chart(
        "Router drift: Jensen-Shannon divergence from the version before",
        series,
        "JS divergence (base 2)",
        "",
        "drift-chart",
        x_label="policy version (from the one before)",
        zero=True,
        cap=1.0,
    )


def _drift_table(source: str, steps: list[VersionDrift]) -> str:
    layers = len(steps[0].divergence)
    rows = [
        [f"{d.before} → {d.after}"] + ["-" if x is None else f"{x:.4f}" for x in d.divergence]
        for d in steps
    ]
    table = _table(["versions"] + [f"L{i}" for i in range(layers)], rows[-TABLE_ROWS:], "drift")
    return (
        f"<h3>{_e(source)} routes, per layer</h3>"
        + _recent(rows, TABLE_ROWS, "steps")
        + f"<div class=scroll>{table}</div>"
    )


def _imbalance_bars(source: str, load: VersionLoad, colour: str) -> str:
    bars = []
    for layer, value in enumerate(stats.imbalance(load.load)):
        row = load.load[layer]
        if value is None:
            hover = f"layer {layer}: no routes counted"
        else:
            hover = (
                f"layer {layer}: busiest expert {int(row.argmax())} has {ratio(value)} the "
                f"mean load ({int(row.max())} of {int(row.sum())} token-layers)"
            )
        bars.append(Bar(layer, value, hover))
    return bar_chart(
        f"Load imbalance per layer: {source} routes, policy version {load.policy_version}",
        bars,
        "busiest expert / mean",
        "layer",
        "x",
        f"imbalance-chart {source}",
        colour,
        reference=(1.0, "1x: an even load"),
    )


def _imbalance_chart(loads: dict[str, list[VersionLoad]]) -> str:
    series = []
    for i, (source, held) in enumerate(loads.items()):
        colour = PALETTE[i % len(PALETTE)]
        mean: list[Point] = []
        top: list[Point] = []
        for v in held:
            at = f"{source} routes, policy version {v.policy_version}"
            per = stats.imbalance(v.load)
            values = [x for x in per if x is not None]
            if not values:
                mean.append((v.policy_version, None, ""))
                top.append((v.policy_version, None, ""))
                continue
            average, layer = sum(values) / len(values), per.index(max(values))
            mean.append((v.policy_version, average, f"{at}: mean over layers {ratio(average)}"))
            top.append(
                (
                    v.policy_version,
                    max(values),
                    f"{at}: most in layer {layer}, {ratio(max(values))}",
                )
            )
        series.append(Series(f"{source}, mean over layers", mean, colour))
        series.append(Series(f"{source}, most imbalanced layer", top, colour, dashed=True))
    return line_chart(
        "Load imbalance over policy versions",
        series,
        "busiest expert / mean",
        "x",
        "imbalance-versions-chart",
    )


def namespace_page(detail: NamespaceDetail, last: int) -> str:
    """One namespace: its figures; agreement between sources, drift across versions
    and load imbalance per layer as charts and tables; expert-load heatmaps of its last
    `last` policy versions per source."""
    info, usage = detail.row.info, detail.row.usage
    spec, settings = info.spec, info.settings
    facts = _table(
        ["", ""],
        [
            [
                "route spec",
                f"{spec.num_layers} layers x {spec.num_experts} experts, top-{spec.top_k}",
            ],
            ["created", time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(info.created_at))],
            ["trajectories", str(usage.trajectories)],
            ["shards", f"{usage.shards} ({_bytes(usage.shard_bytes)})"],
            [
                "live / dead route bytes",
                f"{_bytes(usage.live_route_bytes)} / {_bytes(usage.dead_route_bytes)}",
            ],
            ["policy version", str(info.policy_version)],
            ["versions held", _versions(usage.by_policy_version)],
            ["max policy lag", _or_none(settings.max_policy_lag, "none (never stale)")],
            ["max times sampled", _or_none(settings.max_times_sampled, "none (no limit)")],
            ["retention", _e(_retention(settings.retention))],
            ["checkpoints kept", _e(_kept_checkpoints(settings.retention))],
            ["epoch", str(detail.consumption.epoch)],
            ["samplings / sampled", f"{usage.samplings} / {usage.sampled}"],
            ["read sources", _e(", ".join(settings.read_sources))],
        ],
        "facts",
    )
    loads = {source: held for source, held in detail.loads.items() if held}
    pairs = _pairs(detail)
    agreement = (
        _agreement_chart(pairs) + "".join(_agreement_table(pair, held) for pair, held in pairs)
        if pairs
        else "<p class=muted>No trajectory holds two sources yet.</p>"
    )
    drift = {source: steps for source, steps in detail.drift.items() if steps}
    drifting = (
        "<p class=note>Per layer, the Jensen-Shannon divergence (base 2, 0: the same, 1: "
        "disjoint) of the expert-load distribution of a policy version from that of the "
        "version before it.</p>"
        + _drift_chart(drift)
        + "".join(_drift_table(source, steps) for source, steps in drift.items())
        if drift
        else "<p class=muted>Fewer than two policy versions hold routes.</p>"
    )
    imbalance = ""
    if loads:
        bars = "".join(
            _imbalance_bars(source, held[-1], PALETTE[i % len(PALETTE)])
            for i, (source, held) in enumerate(loads.items())
        )
        over = _imbalance_chart(loads) if any(len(h) > 1 for h in loads.values()) else ""
        imbalance = (
            "<p class=note>Per layer, the busiest expert's load over the mean load of the "
            "layer's experts (1x: perfectly even); the latest policy version of each source."
            f"</p><div class=charts>{bars}{over}</div>"
        )
    shown = {source: held[-last:] for source, held in loads.items()}
    top = scale_top([v for held in shown.values() for v in held])
    maps = "".join(
        f"<h3>{_e(source)} routes</h3><div class=maps>"
        + "".join(heatmap(v, source, top) for v in held)
        + "</div>"
        for source, held in shown.items()
    )
    body = (
        f"{SIGN_OUT}<p><a href='/ui'>all namespaces</a></p><h1>{_e(info.name)}</h1>{facts}"
        "<h2>Trainer checkpoints and leases</h2>"
        + _consumption(detail.consumption)
        + "<h2>Agreement between route sources</h2>"
        + agreement
        + "<h2>Router drift</h2>"
        + drifting
        + "<h2>Load imbalance</h2>"
        + (imbalance or "<p class=muted>No routes counted yet.</p>")
        + f"<h2>Expert load per policy version (the last {last})</h2>"
        + (f"{colour_scale(top)}{maps}" if maps else "<p class=muted>No routes counted yet.</p>")
    )
    return _page(f"r3store · {info.name}", body)


def login_page(message: str, then: str = "/ui") -> str:
    """What a browser without a key gets: a form for the key (kept in a cookie for
    /ui), and where a key comes from."""
    body = (
        f"<h1>r3store</h1><p>{_e(message)}</p>"
        "<form method=post action='/ui/login'><label>API key "
        "<input type=password name=key autocomplete=off autofocus required></label> "
        f"<input type=hidden name=then value='{_e(then)}'>"
        "<button type=submit>Sign in</button></form>"
        "<p class=note>The status page takes any API key with the read right. An operator "
        "makes one on the server's machine with <code>r3store keys create NAME --role "
        "reader</code> (add <code>--namespace NS</code> to limit it to one namespace); the "
        "command shows the key once. The browser keeps a session signed by the server (not "
        "the key) in a cookie for this page only, for 8 hours or until you sign out.</p>"
    )
    return _page("r3store · sign in", body)


def message_page(message: str) -> str:
    """A page saying `message`, with the way back to the namespaces."""
    return _page(
        "r3store", f"<p><a href='/ui'>all namespaces</a></p><h1>r3store</h1><p>{_e(message)}</p>"
    )
