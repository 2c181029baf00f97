"""The examples run as documented (with small sizes)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.mark.slow
def test_r3_mismatch_example_runs() -> None:
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples" / "r3_mismatch.py"),
            "--steps",
            "3",
            "--samples",
            "2",
            "--length",
            "32",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    out = result.stdout
    assert "route agreement with the engine's top-8 sets" in out
    assert "without replay" in out
    assert "with R3 replay" in out
    for layer in range(4):
        line = next(x for x in out.splitlines() if x.strip().startswith(f"layer {layer}:"))
        assert line.split()[-1] == "1.000"  # the experts run under replay are the engine's
