"""The examples run as documented (with small sizes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r3store.testing.service import start_server, stop_server

ROOT = Path(__file__).parent.parent


def test_quickstart_worker_and_trainer_run_against_a_server(tmp_path: Path) -> None:
    """The README's quickstart, as `make serve` runs it: no key, the default namespace."""
    process, url = start_server(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("R3STORE_")}
    env["R3STORE_URL"] = url

    def run(name: str, **extra: str) -> str:
        result = subprocess.run(
            [sys.executable, str(ROOT / "examples" / name)],
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout

    try:
        worker = run("rollout_worker.py")
        assert "sent 16, refused 0, unsent 0" in worker
        assert "16 trajectories in 'quickstart'" in worker
        assert "sent 16" in run("rollout_worker.py")  # again: acknowledged, not stored twice
        assert "16 trajectories in 'quickstart'" in run("rollout_worker.py")
        ranks = [run("trainer.py", RANK=str(r), WORLD_SIZE="2") for r in range(2)]
    finally:
        stop_server(process)
    for rank, out in enumerate(ranks):
        assert f"rank {rank}: replayed 8 trajectories of 'quickstart'" in out
        losses = re.findall(r"trajectories replayed, loss (\d+\.\d+)", out)
        assert len(losses) == 2
        assert all(0 < float(loss) < 10 for loss in losses)


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
