"""SVG charts of the status page, from plain values: expert-load heatmaps with their
colour scale, line charts over policy versions and bar charts per layer. Every chart
has axes with tick labels and a title; every drawn value has an SVG `<title>`, which a
browser shows on hover. Text from names is HTML-escaped; no script."""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from r3store.engine.analytics import VersionLoad

SVG = "xmlns='http://www.w3.org/2000/svg'"
PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
_EVEN = (255, 255, 255)  # an even share of the layer's load
_UNDER = (33, 102, 172)  # the bottom of the scale
_OVER = (178, 24, 43)  # the top of the scale
_NONE = "#111111"  # an expert no token-layer chose
_EMPTY = "#e4e4e4"  # a layer with no routes counted

STYLE = """
svg text{font:11px system-ui,sans-serif;fill:#333}svg text.title{font-size:13px;font-weight:600}
svg .axis{stroke:#888;stroke-width:1}svg .grid{stroke:#e6e6e6;stroke-width:1}
svg .ref{stroke:#555;stroke-width:1;stroke-dasharray:4 3}
figure.chart,figure.scale{display:inline-block;vertical-align:top}
figure.scale figcaption{max-width:392px}
.legend{font-size:12px;color:#333;display:flex;flex-wrap:wrap;gap:4px 14px;margin-top:2px;
max-width:560px}
.legend svg{vertical-align:middle;margin-right:4px}
.charts{display:flex;flex-wrap:wrap;gap:16px;align-items:flex-start}
"""


def e(value: object) -> str:
    return html.escape(str(value), quote=True)


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def ratio(value: float) -> str:
    return f"{value:.2f}x"


def plain(value: float) -> str:
    return f"{value:.4f}"


def _decimals(step: float) -> int:
    for d in range(7):
        if abs(step * 10**d - round(step * 10**d)) < 1e-6 * max(1.0, step * 10**d):
            return d
    return 6


def tick_label(value: float, step: float, unit: str) -> str:
    """A tick's label, with as many decimals as its step needs."""
    if abs(value) < 1e-12:
        return "0"
    if unit == "%":
        return f"{100 * value:.{_decimals(100 * step)}f}%"
    return f"{value:.{_decimals(step)}f}{unit}"


def _nice(raw: float) -> float:
    """The smallest of 1, 2, 2.5 and 5 times a power of ten that is at least `raw`."""
    power = 10.0 ** math.floor(math.log10(raw))
    for m in (1, 2, 2.5, 5, 10):
        if m * power >= raw * (1 - 1e-9):
            return m * power
    return 10 * power


def axis(
    values: Sequence[float], zero: bool = False, cap: float | None = None, count: int = 5
) -> tuple[float, float, list[float]]:
    """A value axis holding `values`: its low and high ends and its ticks (nice
    numbers); from 0 if `zero`, never above `cap`."""
    lo, hi = min(values), max(values)
    positive = lo >= 0
    if zero:
        lo = min(0.0, lo)
    if hi - lo < 1e-12:
        pad = max(abs(hi) * 0.05, 1e-3)
        lo, hi = (lo if zero else lo - pad), hi + pad
    else:  # no value on the frame's edge
        pad = (hi - lo) * 0.04
        lo, hi = (lo if zero or lo == 0 else lo - pad), hi + pad
    if cap is not None:
        hi = max(min(hi, cap), max(values))
    step = _nice((hi - lo) / count)
    low = math.floor(lo / step + 1e-9) * step
    high = math.ceil(hi / step - 1e-9) * step
    if cap is not None and high > cap >= hi:
        high = cap
    if positive and low < 0:
        low = 0.0
    ticks = []
    n = 0
    while low + n * step <= high + step * 1e-9:
        ticks.append(round(low + n * step, 12))
        n += 1
    return low, high, ticks


def int_ticks(lo: int, hi: int, room: float, spacing: float = 36) -> list[int]:
    """Integer ticks from `lo` to `hi` at a nice step, about `spacing` px apart over
    `room` px."""
    if hi <= lo:
        return [lo]
    most = max(1, int(room // spacing))
    step = max(1, math.ceil(_nice(max(1e-9, (hi - lo) / most))))
    first = math.ceil(lo / step) * step
    return list(range(first, hi + 1, step))


Point = tuple[int, float | None, str]  # policy version, value, what hovering shows


@dataclass(frozen=True)
class Series:
    """One line: per policy version, a value (None: not measured there) and what
    hovering over its point shows."""

    name: str
    points: Sequence[Point]
    colour: str
    dashed: bool = False


@dataclass(frozen=True)
class Frame:
    """A chart's plot area inside its SVG."""

    width: int = 560
    height: int = 250
    left: int = 64
    right: int = 16
    top: int = 30
    bottom: int = 44

    @property
    def plot_w(self) -> int:
        return self.width - self.left - self.right

    @property
    def plot_h(self) -> int:
        return self.height - self.top - self.bottom


def _frame_svg(
    frame: Frame,
    css: str,
    title: str,
    x_label: str,
    y_label: str,
    y: Callable[[float], float],
    y_ticks: Sequence[float],
    y_step: float,
    unit: str,
    body: str,
    x_ticks: str,
) -> str:
    f = frame
    bottom = f.top + f.plot_h
    grid = "".join(
        f"<line class=grid x1={f.left} x2={f.left + f.plot_w} y1={y(t):.1f} y2={y(t):.1f}></line>"
        f"<text class=ytick x={f.left - 6} y={y(t) + 4:.1f} text-anchor=end>"
        f"{e(tick_label(t, y_step, unit))}</text>"
        for t in y_ticks
    )
    return (
        f"<svg class='chart {e(css)}' {SVG} width={f.width} height={f.height} "
        f"viewBox='0 0 {f.width} {f.height}' role=img aria-label='{e(title)}'>"
        f"<title>{e(title)}</title>"
        f"<text class=title x={f.left} y=16>{e(title)}</text>{grid}"
        f"<line class=axis x1={f.left} x2={f.left} y1={f.top} y2={bottom}></line>"
        f"<line class=axis x1={f.left} x2={f.left + f.plot_w} y1={bottom} y2={bottom}></line>"
        f"{x_ticks}{body}"
        f"<text class=xlabel x={f.left + f.plot_w / 2:.1f} y={f.height - 6} "
        f"text-anchor=middle>{e(x_label)}</text>"
        f"<text class=ylabel text-anchor=middle "
        f"transform='translate(14 {f.top + f.plot_h / 2:.1f}) rotate(-90)'>{e(y_label)}</text>"
        "</svg>"
    )


def _swatch(colour: str, dashed: bool) -> str:
    dash = " stroke-dasharray='4 3'" if dashed else ""
    return (
        f"<svg {SVG} width=22 height=10><line x1=1 x2=21 y1=5 y2=5 stroke='{e(colour)}' "
        f"stroke-width=2{dash}></line></svg>"
    )


def legend(entries: Sequence[tuple[str, str, bool]]) -> str:
    """Names with the stroke of their line: (name, colour, dashed)."""
    return (
        "<div class=legend>"
        + "".join(f"<span>{_swatch(c, d)}{e(n)}</span>" for n, c, d in entries)
        + "</div>"
    )


def line_chart(
    title: str,
    series: Sequence[Series],
    y_label: str,
    unit: str,
    css: str,
    x_label: str = "policy version",
    zero: bool = False,
    cap: float | None = None,
) -> str:
    """Lines over policy versions, a point per value with its value on hover; a gap
    where a series has no value."""
    values = [v for s in series for _, v, _ in s.points if v is not None]
    versions = [x for s in series for x, v, _ in s.points if v is not None]
    if not values:
        return ""
    f = Frame()
    low, high, y_ticks = axis(values, zero=zero, cap=cap)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else max(high - low, 1e-3)
    x_lo, x_hi = min(versions), max(versions)
    span = max(1, x_hi - x_lo)
    pad = 0.04 * span if x_hi > x_lo else 0.5

    def x(version: float) -> float:
        return f.left + (version - x_lo + pad) / (span + 2 * pad) * f.plot_w

    def y(value: float) -> float:
        return f.top + (high - value) / (high - low) * f.plot_h

    bottom = f.top + f.plot_h
    xt = "".join(
        f"<line class=axis x1={x(t):.1f} x2={x(t):.1f} y1={bottom} y2={bottom + 4}></line>"
        f"<text class=xtick x={x(t):.1f} y={bottom + 16} text-anchor=middle>{t}</text>"
        for t in int_ticks(x_lo, x_hi, f.plot_w, 40)
    )
    radius = 3.5 if len(set(versions)) <= 60 else 2
    body = []
    for s in series:
        dash = " stroke-dasharray='5 3'" if s.dashed else ""
        run: list[str] = []
        runs: list[list[str]] = [run]
        marks = []
        for version, value, hover in s.points:
            if value is None:
                run = []
                runs.append(run)
                continue
            px, py = x(version), y(value)
            run.append(f"{px:.1f},{py:.1f}")
            marks.append(
                f"<circle class=point cx={px:.1f} cy={py:.1f} r={radius} fill='{e(s.colour)}' "
                f"data-series='{e(s.name)}' data-x={version} data-y={value:.6g}>"
                f"<title>{e(hover)}</title></circle>"
            )
        lines = "".join(
            f"<polyline class=line points='{' '.join(r)}' fill=none stroke='{e(s.colour)}' "
            f"stroke-width=2{dash} data-series='{e(s.name)}'></polyline>"
            for r in runs
            if len(r) > 1
        )
        body.append(f"<g class=series data-series='{e(s.name)}'>{lines}{''.join(marks)}</g>")
    svg = _frame_svg(f, css, title, x_label, y_label, y, y_ticks, y_step, unit, "".join(body), xt)
    return (
        f"<figure class=chart>{svg}"
        + legend([(s.name, s.colour, s.dashed) for s in series])
        + "</figure>"
    )


@dataclass(frozen=True)
class Bar:
    label: int  # the x position's name (a layer)
    value: float | None
    hover: str


def bar_chart(
    title: str,
    bars: Sequence[Bar],
    y_label: str,
    x_label: str,
    unit: str,
    css: str,
    colour: str = PALETTE[0],
    reference: tuple[float, str] | None = None,
) -> str:
    """A bar per position from 0, its value on hover; an optional dashed reference
    line, such as 1x for an even load."""
    values = [b.value for b in bars if b.value is not None]
    if not values:
        return ""
    f = Frame()
    if reference is not None:
        values.append(reference[0])
    low, high, y_ticks = axis(values, zero=True)
    y_step = y_ticks[1] - y_ticks[0] if len(y_ticks) > 1 else high - low

    def y(value: float) -> float:
        return f.top + (high - value) / (high - low) * f.plot_h

    slot = f.plot_w / len(bars)
    gap = max(min(2.0, slot * 0.2), slot - 36)  # bars of 36 px at most
    bottom = f.top + f.plot_h
    rects = []
    for i, bar in enumerate(bars):
        if bar.value is None:
            continue
        top = y(bar.value)
        rects.append(
            f"<rect class=bar x={f.left + i * slot + gap / 2:.1f} y={top:.1f} "
            f"width={max(1.0, slot - gap):.1f} height={bottom - top:.1f} fill='{e(colour)}' "
            f"data-label={bar.label} data-value={bar.value:.6g}><title>{e(bar.hover)}</title>"
            "</rect>"
        )
    if reference is not None:
        ry = y(reference[0])
        rects.append(
            f"<line class=ref x1={f.left} x2={f.left + f.plot_w} y1={ry:.1f} y2={ry:.1f}>"
            f"<title>{e(reference[1])}</title></line>"
        )
    labels = [b.label for b in bars]
    xt = "".join(
        f"<text class=xtick x={f.left + (labels.index(t) + 0.5) * slot:.1f} y={bottom + 16} "
        f"text-anchor=middle>{t}</text>"
        for t in int_ticks(labels[0], labels[-1], f.plot_w, 30)
        if t in labels
    )
    key = legend([(reference[1], "#555", True)]) if reference is not None else ""
    return (
        "<figure class=chart>"
        + _frame_svg(f, css, title, x_label, y_label, y, y_ticks, y_step, unit, "".join(rects), xt)
        + key
        + "</figure>"
    )


# heatmaps


def _mix(a: tuple[int, int, int], b: tuple[int, int, int], t: float) -> str:
    t = min(1.0, max(0.0, t))
    r, g, bl = (round(x + (y - x) * t) for x, y in zip(a, b, strict=True))
    return f"#{r:02x}{g:02x}{bl:02x}"


def shade(share: float, top: float) -> str:
    """The colour of a load `share` times the layer's mean, on a log scale: blue for
    less (darkest at 1/`top` or below), white for an even share, red for more (darkest
    at `top`); black for none."""
    if share <= 0:
        return _NONE
    t = max(-1.0, min(1.0, math.log2(share) / math.log2(top)))
    return _mix(_EVEN, _UNDER, -t) if t < 0 else _mix(_EVEN, _OVER, t)


def scale_top(loads: Sequence[VersionLoad]) -> float:
    """The top of the colour scale for these loads: the largest load over its layer's
    mean, rounded up to a power of two, at least 2."""
    top = 2.0
    for v in loads:
        for row in v.load:
            total = int(row.sum())
            if total:
                top = max(top, float(row.max()) * row.size / total)
    return float(2 ** math.ceil(math.log2(top) - 1e-9))


def _power(k: int) -> str:
    return f"{2**k}x" if k >= 0 else f"1/{2**-k}x"


def colour_scale(top: float) -> str:
    """The legend of the heatmaps' colours: black for no load, then on a log scale
    from 1/`top` through an even share (1x) to `top` times the layer's mean."""
    width, left, bar = 320, 12, 60
    m = max(1, round(math.log2(top)))
    stride = 1
    while width / (2 * m) * stride < 34:
        stride += 1
    ticks = [k for k in range(-m, m + 1) if k % stride == 0]

    def x(k: int) -> float:
        return bar + (k + m) / (2 * m) * width

    marks = "".join(
        f"<line class=axis x1={x(k):.1f} x2={x(k):.1f} y1=18 y2=22></line>"
        f"<text class=tick x={x(k):.1f} y=34 text-anchor=middle>{_power(k)}</text>"
        for k in ticks
    )
    return (
        "<figure class=scale><figcaption>Colour: an expert's load over its layer's mean, "
        "on a log scale (white: an even share; black: no token chose it; grey: no routes "
        "in the layer)</figcaption>"
        f"<svg class=colour-scale {SVG} width={bar + width + left} height=40 "
        f"data-top={top:g}><title>colour scale: an expert's load over its layer's mean, "
        "log scale</title><defs><linearGradient id=load-scale>"
        f"<stop offset=0 stop-color='{shade(1 / top, top)}'></stop>"
        f"<stop offset=0.5 stop-color='{shade(1, top)}'></stop>"
        f"<stop offset=1 stop-color='{shade(top, top)}'></stop>"
        "</linearGradient></defs>"
        f"<rect x={left} y=6 width=16 height=12 fill='{_NONE}' stroke='#999'></rect>"
        f"<text class=tick x={left + 8} y=34 text-anchor=middle>0</text>"
        f"<rect x={bar} y=6 width={width} height=12 fill='url(#load-scale)' stroke='#999'>"
        f"</rect>{marks}</svg></figure>"
    )


def cell_size(layers: int, experts: int) -> tuple[int, int]:
    """Cell width and height: maps of about 480 x 200 px, cells of 2 to 20 px (a 4 x 16
    map draws 20 px cells)."""
    return min(20, max(2, 480 // max(1, experts))), min(20, max(2, 200 // max(1, layers)))


def heatmap(load: VersionLoad, source: str, top: float) -> str:
    """One policy version's `[L, E]` load: a row per layer, a column per expert,
    coloured by the expert's load over its layer's mean; each cell's count on hover."""
    layers, experts = load.load.shape
    cw, ch = cell_size(layers, experts)
    left, head, foot = 36, 6, 34
    rows = []
    for layer in range(layers):
        row = load.load[layer]
        total = int(row.sum())
        mean = total / experts if total else 0.0
        cells = []
        for expert in range(experts):
            count = int(row[expert])
            share = count / mean if mean else 0.0
            fill = shade(share, top) if total else _EMPTY
            cells.append(
                f"<rect x={expert * cw} width={cw} height={ch} fill={fill} data-count={count}>"
                f"<title>layer {layer}, expert {expert}: {count} token-layers "
                f"({share:.2f}x the mean)</title></rect>"
            )
        rows.append(
            f"<g class=row data-layer={layer} transform='translate({left} {head + layer * ch})'>"
            + "".join(cells)
            + "</g>"
        )
    width, height = left + experts * cw + 8, head + layers * ch + foot
    bottom = head + layers * ch
    xt = "".join(
        f"<text class=xtick x={left + (t + 0.5) * cw:.1f} y={bottom + 13} "
        f"text-anchor=middle>{t}</text>"
        for t in int_ticks(0, experts - 1, experts * cw, 28)
    )
    yt = "".join(
        f"<text class=ytick x={left - 4} y={head + (t + 0.5) * ch + 4:.1f} "
        f"text-anchor=end>{t}</text>"
        for t in int_ticks(0, layers - 1, layers * ch, 14)
    )
    labels = (
        f"<text class=xlabel x={left + experts * cw / 2:.1f} y={height - 4} "
        "text-anchor=middle>expert</text>"
        f"<text class=ylabel text-anchor=middle transform='translate(10 "
        f"{head + layers * ch / 2:.1f}) rotate(-90)'>layer</text>"
    )
    return (
        f"<figure><svg class=heatmap {SVG} width={width} height={height} "
        f"data-version={load.policy_version} data-source='{e(source)}' data-layers={layers} "
        f"data-experts={experts}><title>{e(source)} routes, policy version "
        f"{load.policy_version}: expert load per layer</title>{''.join(rows)}{xt}{yt}{labels}"
        f"</svg><figcaption>policy version {load.policy_version} · {load.tokens} tokens"
        "</figcaption></figure>"
    )
