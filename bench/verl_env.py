"""Benchmarks that run in verl's environment (`.venv-verl`: verl, TransferQueue, Ray at
the versions verl pins), started from `python -m bench` as a process of their own."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.figures import Figure

ROOT = Path(__file__).resolve().parent.parent
PYTHON = ROOT / ".venv-verl" / "bin" / "python"


def run(module: str, quick: bool = False) -> tuple[list[Figure], dict[str, Any]]:
    """Run `python -m <module> --json <file>` there; its figures and details."""
    if not PYTHON.exists():
        raise SystemExit(f"{module} runs in .venv-verl: make .venv-verl/.installed first")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [str(PYTHON), "-m", module, "--json", str(out), *(["--quick"] if quick else [])]
        subprocess.run(command, cwd=ROOT, check=True)
        found = json.loads(out.read_text())
    figures = [Figure(**f) for f in found.pop("figures")]
    return figures, found
