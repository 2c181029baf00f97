"""What the command line prints: JSON with `--json`; for people, `key: value` lines,
records as aligned columns, times as UTC dates, durations in days, hours and minutes and
expert statistics layer by layer; and a progress bar on stderr when it is a terminal."""

from __future__ import annotations

import datetime
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from r3store_server.cli.arguments import duration
from r3store_server.cli.commands import Output


def progress(label: str) -> Callable[[int, int], None] | None:
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
            return duration(value)
    return value


def write(value: Output, as_json: bool) -> None:
    """JSON with `--json`; for people, `key: value` lines (nested ones indented), lists
    of records as aligned columns, expert statistics layer by layer."""
    if as_json:
        print(json.dumps(value, indent=2, default=str))
        return
    shown = human(value)
    if isinstance(shown, dict):
        lines = _lines(shown)
    elif isinstance(shown, list) and all(isinstance(item, dict) for item in shown):
        if shown and all("spec" in item and "settings" in item for item in shown):
            shown = [_namespace_row(item) for item in shown]
        lines = _table(shown) if shown else ["none"]
    else:
        lines = [_cell(shown)]
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
