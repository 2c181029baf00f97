"""The size budget that `make lint` enforces: no module over the line limit.

The limit and the few modules allowed past it (each with its reason) live in one
place, `[tool.r3store.size-budget]` in pyproject.toml. A listed module that has come
back under the limit is reported too, so that the list only ever names real
exceptions. Exit status 1 on any finding.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("r3store", "server/r3store_server", "client/r3store_client")


def findings(root: Path = ROOT) -> list[str]:
    budget = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["r3store"]
    budget = budget["size-budget"]
    limit: int = budget["max-lines"]
    allowed: dict[str, str] = budget.get("allowed", {})
    out = []
    if len(allowed) > budget["max-allowed"]:
        out.append(
            f"{len(allowed)} modules allowed past the limit, at most {budget['max-allowed']}"
        )
    sizes = {
        path.relative_to(root).as_posix(): len(path.read_bytes().splitlines())
        for package in PACKAGES
        for path in sorted((root / package).rglob("*.py"))
    }
    for name, lines in sorted(sizes.items()):
        if lines > limit and name not in allowed:
            out.append(f"{name}: {lines} lines, over the limit of {limit}")
    for name, reason in sorted(allowed.items()):
        if not reason.strip():
            out.append(f"{name}: allowed past the limit without a reason")
        if sizes.get(name, 0) <= limit:
            out.append(
                f"{name}: listed as allowed past the limit, but has {sizes.get(name, 0)} lines"
            )
    return out


def main() -> int:
    found = findings()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
