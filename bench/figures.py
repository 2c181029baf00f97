"""Benchmark figures: one measured value, with the baseline it is compared with."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Figure:
    name: str
    value: float
    unit: str
    baseline: float | None = None
    baseline_name: str | None = None
    target: str | None = None

    @property
    def ratio(self) -> float | None:
        if not self.baseline:
            return None
        return self.value / self.baseline


def median_of(runs: int, measure: Callable[[], float]) -> float:
    """The median of `runs` measurements (machines are noisy)."""
    return statistics.median(measure() for _ in range(runs))


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def print_table(figures: list[Figure]) -> None:
    header = f"{'figure':<58} {'value':>12} {'unit':<16} {'baseline':>12} {'ratio':>7}  target"
    print(header)
    print("-" * len(header))
    for f in figures:
        base = "" if f.baseline is None else f"{f.baseline:12.4g}"
        ratio = "" if f.ratio is None else f"{f.ratio:7.2f}"
        print(f"{f.name:<58} {f.value:12.4g} {f.unit:<16} {base:>12} {ratio:>7}  {f.target or ''}")


def write_json(
    figures: list[Figure], path: Path, seconds: float, details: dict[str, object] | None = None
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"python": platform.python_version(), "cpu_count": __import__("os").cpu_count()},
        "seconds": round(seconds, 1),
        "figures": [{**asdict(f), "ratio": f.ratio} for f in figures],
        **({"details": details} if details else {}),
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
