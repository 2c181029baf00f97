"""The namespace page's analytics, from `Engine.analytics`' values: agreement between
route sources, router drift and load imbalance, each as charts over policy versions
and tables per layer, and the expert-load heatmaps of the newest policy versions."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from r3store.engine.analytics import VersionAgreement, VersionDrift, VersionLoad
from r3store.logic import stats
from r3store_server.ui_charts import (
    PALETTE,
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
from r3store_server.ui_html import share, table

TABLE_ROWS = 12  # versions a table lists; the charts show all
_NO_ROUTES = "<p class=muted>No routes counted yet.</p>"

Pairs = dict[tuple[str, str], list[VersionAgreement]]


def _colour(i: int) -> str:
    return PALETTE[i % len(PALETTE)]


def _newest_table(
    title: str, head: Sequence[str], rows: list[list[str]], css: str, what: str
) -> str:
    """A per-layer table of the newest `TABLE_ROWS` rows, saying when there are more."""
    shown = table(head, rows[-TABLE_ROWS:], css)
    more = ""
    if len(rows) > TABLE_ROWS:
        more = (
            f"<p class=muted>The last {TABLE_ROWS} of {len(rows)} {what}; the chart shows all.</p>"
        )
    return f"<h3>{title}</h3>{more}<div class=scroll>{shown}</div>"


def _mean_and_most(
    source: str,
    colour: str,
    most: str,
    steps: Iterable[tuple[int, str, Sequence[float | None]]],
    show: Callable[[float], str],
) -> list[Series]:
    """A source's two lines over policy versions from its values per layer: their mean,
    and (dashed) the layer with the most, `most` naming it. `steps`: per version, its x,
    what hovering names it and its values per layer (None: not measured)."""
    mean: list[Point] = []
    top: list[Point] = []
    for x, at, per in steps:
        values = [v for v in per if v is not None]
        if not values:
            mean.append((x, None, ""))
            top.append((x, None, ""))
            continue
        average, highest = sum(values) / len(values), max(values)
        mean.append((x, average, f"{at}: mean over layers {show(average)}"))
        top.append((x, highest, f"{at}: most in layer {per.index(highest)}, {show(highest)}"))
    return [
        Series(f"{source}, mean over layers", mean, colour),
        Series(f"{source}, {most}", top, colour, dashed=True),
    ]


def _lowest(v: VersionAgreement) -> tuple[int, float] | None:
    held = [(f, i) for i, f in enumerate(v.overlap.fraction) if f is not None]
    if not held:
        return None
    value, layer = min(held)
    return layer, value


def _agreement_points(name: str, v: VersionAgreement) -> tuple[Point, Point]:
    """A version's agreement over all layers, and in its lowest layer."""
    at = f"{name}, policy version {v.policy_version}"
    value = v.overlap.overall
    overall = (
        v.policy_version,
        value,
        f"{at}: {share(value)} of the chosen experts agree over all layers "
        f"({v.segments} segments, {v.tokens} tokens)",
    )
    low = _lowest(v)
    if low is None:
        return overall, (v.policy_version, None, "")
    return overall, (v.policy_version, low[1], f"{at}: lowest is layer {low[0]}, {percent(low[1])}")


def _agreement_chart(pairs: Pairs) -> str:
    series = []
    for i, ((a, b), held) in enumerate(pairs.items()):
        name = f"{a} vs {b}"
        points = [_agreement_points(name, v) for v in held]
        series.append(Series(f"{name}, all layers", [p[0] for p in points], _colour(i)))
        lowest = [p[1] for p in points]
        series.append(Series(f"{name}, lowest layer", lowest, _colour(i), dashed=True))
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
        [str(v.policy_version), str(v.segments), str(v.tokens), share(v.overlap.overall)]
        + [
            f"<span data-layer={i} data-agreement={'' if f is None else f'{f:.6f}'}>"
            f"{share(f)}</span>"
            for i, f in enumerate(v.overlap.fraction)
        ]
        for v in held
    ]
    head = ["policy version", "segments", "tokens", "all layers"] + [f"L{i}" for i in range(layers)]
    title = f"{e(pair[0])} vs {e(pair[1])}, per layer"
    css = f"agreement {e(pair[0])}-{e(pair[1])}"
    return _newest_table(title, head, rows, css, "policy versions")


def agreement_section(agreements: Pairs) -> str:
    """Agreement between each two route sources: a chart, and a table per pair."""
    pairs = {pair: held for pair, held in agreements.items() if held}
    if not pairs:
        return "<p class=muted>No trajectory holds two sources yet.</p>"
    return _agreement_chart(pairs) + "".join(
        _agreement_table(pair, held) for pair, held in pairs.items()
    )


def _drift_chart(drift: dict[str, list[VersionDrift]]) -> str:
    series = []
    for i, (source, steps) in enumerate(drift.items()):
        at = f"{source} routes, policy version"
        points = [(d.after, f"{at} {d.before} → {d.after}", d.divergence) for d in steps]
        series += _mean_and_most(source, _colour(i), "most drifting layer", points, plain)
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
    head = ["versions"] + [f"L{i}" for i in range(layers)]
    return _newest_table(f"{e(source)} routes, per layer", head, rows, "drift", "steps")


def drift_section(drift: dict[str, list[VersionDrift]]) -> str:
    """Router drift per source: what it measures, a chart, and a table per source."""
    drifted = {source: steps for source, steps in drift.items() if steps}
    if not drifted:
        return "<p class=muted>Fewer than two policy versions hold routes.</p>"
    return (
        "<p class=note>Per layer, the Jensen-Shannon divergence (base 2, 0: the same, 1: "
        "disjoint) of the expert-load distribution of a policy version from that of the "
        "version before it.</p>"
        + _drift_chart(drifted)
        + "".join(_drift_table(source, steps) for source, steps in drifted.items())
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
        at = f"{source} routes, policy version"
        points = [
            (v.policy_version, f"{at} {v.policy_version}", stats.imbalance(v.load)) for v in held
        ]
        series += _mean_and_most(source, _colour(i), "most imbalanced layer", points, ratio)
    return line_chart(
        "Load imbalance over policy versions",
        series,
        "busiest expert / mean",
        "x",
        "imbalance-versions-chart",
    )


def imbalance_section(loads: dict[str, list[VersionLoad]]) -> str:
    """Load imbalance per layer of each source's newest policy version, and over its
    versions where it has more than one."""
    held = {source: versions for source, versions in loads.items() if versions}
    if not held:
        return _NO_ROUTES
    bars = "".join(
        _imbalance_bars(source, versions[-1], _colour(i))
        for i, (source, versions) in enumerate(held.items())
    )
    over = _imbalance_chart(held) if any(len(h) > 1 for h in held.values()) else ""
    return (
        "<p class=note>Per layer, the busiest expert's load over the mean load of the "
        "layer's experts (1x: perfectly even); the latest policy version of each source."
        f"</p><div class=charts>{bars}{over}</div>"
    )


def heatmap_section(loads: dict[str, list[VersionLoad]], last: int) -> str:
    """Per source, the expert-load heatmaps of its `last` newest policy versions, over
    one colour scale."""
    shown = {source: held[-last:] for source, held in loads.items() if held}
    top = scale_top([v for held in shown.values() for v in held])
    maps = "".join(
        f"<h3>{e(source)} routes</h3><div class=maps>"
        + "".join(heatmap(v, source, top) for v in held)
        + "</div>"
        for source, held in shown.items()
    )
    return f"{colour_scale(top)}{maps}" if maps else _NO_ROUTES
