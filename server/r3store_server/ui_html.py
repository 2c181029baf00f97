"""The HTML every page of the status page shares: the page with its style, tables, and
values in words (sizes, shares, durations, times). Text from names is the caller's to
escape (`ui_charts.e`)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from r3store_server.ui_charts import STYLE, e

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


def page(title: str, body: str) -> str:
    """A whole page: `body` under `title`, with the page's and the charts' style."""
    return (
        "<!doctype html><html lang=en><head><meta charset=utf-8>"
        f"<title>{e(title)}</title><style>{_STYLE}{STYLE}</style></head><body>{body}</body></html>"
    )


def table(head: Sequence[str], rows: Sequence[Sequence[str]], css: str = "") -> str:
    """A table of HTML cells, its first column the names (left-aligned)."""
    cells = "".join(f"<th{' class=name' if i == 0 else ''}>{h}</th>" for i, h in enumerate(head))
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=name' if i == 0 else ''}>{c}</td>" for i, c in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table class='{css}'><tr>{cells}</tr>{body}</table>"


def size(n: int) -> str:
    """Bytes in the largest binary unit below 1024 of it: `512 B`, `1.5 MiB`."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


def share(value: float | None) -> str:
    """A fraction as a percentage with one decimal; `-` where there is none."""
    return "-" if value is None else f"{100 * value:.1f}%"


def or_none(value: object, none: str = "none") -> str:
    return none if value is None else str(value)


def duration(seconds: float) -> str:
    """A duration in its largest unit: `2 d`, `1.5 h`, `10 min`, `30 s`."""
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{seconds / length:.3g} {unit}"
    return f"{seconds:g} s"


def remaining(seconds: float) -> str:
    """A time left, in its two largest units: `2 h 5 min`, `9 min 58 s`, `45 s`."""
    left = max(int(seconds), 0)
    parts = [(left // 86400, "d"), (left % 86400 // 3600, "h"), (left % 3600 // 60, "min")]
    parts.append((left % 60, "s"))
    shown = [f"{n} {unit}" for n, unit in parts if n]
    return " ".join(shown[:2]) or "0 s"


def when(stamp: float) -> str:
    """A time (seconds since the epoch) as the server's local date and time."""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(stamp))
