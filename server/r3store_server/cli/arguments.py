"""The command line's argument types: trainer steps, whole numbers in a range, durations,
`none` for a setting cleared; and `duration`, seconds shown in the form `--ttl` takes."""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from typing import Any

from r3store.leases import MAX_STEP
from r3store.policy import MAX_POLICY_VERSION, MAX_TTL_SECONDS

CLEAR = "none"
DURATIONS = "90s, 30m, 12h, 1d, '1d 2h' or plain seconds (86400)"
_UNITS = {"d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)([dhms])")


def _within(text: str, low: int, high: int) -> int | None:
    """`text` as a whole number from `low` to `high`, or None."""
    try:
        value = int(text)
    except ValueError:
        return None
    return value if low <= value <= high else None


def step(text: str) -> int:
    """An argparse type: a trainer step, a whole number from 0 to 2^63 - 1."""
    value = _within(text, 0, MAX_STEP)
    if value is None:
        raise argparse.ArgumentTypeError(
            f"expected a step, a whole number from 0 to 2^63 - 1; got {text!r}"
        )
    return value


def optional(kind: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type: `kind`, or `none` (the setting cleared)."""

    def parse(text: str) -> Any:
        return CLEAR if text.strip().lower() == CLEAR else kind(text)

    parse.__name__ = kind.__name__
    return parse


def whole_number(low: int, high: int) -> Callable[[str], int]:
    """An argparse type: a whole number from `low` to `high`, refused in one line."""

    def whole(text: str) -> int:
        value = _within(text, low, high)
        if value is None:
            top = "2^63 - 1" if high == MAX_POLICY_VERSION else str(high)
            raise argparse.ArgumentTypeError(
                f"expected none or a whole number from {low} to {top}; got {text!r}"
            )
        return value

    return whole


def seconds(text: str) -> float:
    """An argparse type: a duration as `duration` shows it (`90s`, `30m`, `12h`, `1d`,
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


def duration(value: float) -> str:
    """`90061.5` as `1d 1h 1m 1.5s`, a form `--ttl` takes back."""
    parts, rest = [], float(value)
    for unit, size in _UNITS.items():
        if unit != "s" and rest >= size:
            count = int(rest // size)
            parts.append(f"{count}{unit}")
            rest -= count * size
    if rest or not parts:
        parts.append(f"{rest:g}s")
    return " ".join(parts)
