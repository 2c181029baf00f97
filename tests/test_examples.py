"""The examples run as documented (with small sizes)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from r3store.policy import NamespaceSettings, Retention
from r3store.spec import RouteSpec
from r3store.testing.service import start_server, stop_server
from r3store_client import Client

ROOT = Path(__file__).parent.parent
QUICKSTART = RouteSpec(4, 16, 2)  # the examples' model


def run_example(name: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def without_settings() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("R3STORE_")}


def test_quickstart_worker_and_trainer_run_against_a_server(tmp_path: Path) -> None:
    """The README's quickstart, as `make serve` runs it: no key, the default namespace."""
    process, url = start_server(tmp_path)
    env = {**without_settings(), "R3STORE_URL": url}

    def run(name: str, **extra: str) -> str:
        result = run_example(name, {**env, **extra})
        assert result.returncode == 0, result.stderr
        return result.stdout

    try:
        worker = run("rollout_worker.py")
        assert "sent 16, refused 0, unsent 0" in worker
        assert "16 trajectories in 'quickstart'" in worker
        assert "sent 16" in run("rollout_worker.py")  # again: acknowledged, not stored twice
        with Client(url) as operator:  # as `r3store settings quickstart --keep-versions 4`
            operator.update_settings(
                "quickstart", NamespaceSettings(retention=Retention(keep_versions=4))
            )
        assert "16 trajectories in 'quickstart'" in run("rollout_worker.py")  # still starts
        ranks = [run("trainer.py", RANK=str(r), WORLD_SIZE="2") for r in range(2)]
        with Client(url) as operator:
            info = operator.namespace("quickstart")
    finally:
        stop_server(process)
    assert info.policy_version == 2  # rank 0 moved it on after its step
    assert info.settings.retention.keep_versions == 4
    for rank, out in enumerate(ranks):
        assert f"rank {rank}: replayed 8 trajectories of 'quickstart'" in out
        losses = re.findall(r"trajectories replayed, loss (\d+\.\d+)", out)
        assert len(losses) == 2
        assert all(0 < float(loss) < 10 for loss in losses)


def test_worker_runs_with_a_writer_key_once_the_namespace_exists(tmp_path: Path) -> None:
    """What the worker's docstring and the README's "Keys" say: a `writer` key, once an
    operator made the namespace; before that, an error that says an admin key is needed."""
    keys = {"admin": "admin-key-0123456789abcdefghij", "writer": "writer-key-0123456789abcdef"}
    configured = [{"name": role, "role": role, "key": key} for role, key in keys.items()]
    process, url = start_server(tmp_path, {"R3STORE_API_KEYS": json.dumps(configured)})
    env = {**without_settings(), "R3STORE_URL": url, "R3STORE_KEY": keys["writer"]}
    try:
        early = run_example("rollout_worker.py", env)
        assert early.returncode != 0
        assert "needs an admin key" in early.stderr
        with Client(url, api_key=keys["admin"]) as operator:
            operator.create_namespace("quickstart", QUICKSTART)
        result = run_example("rollout_worker.py", env)
    finally:
        stop_server(process)
    assert result.returncode == 0, result.stderr
    assert "sent 16, refused 0, unsent 0" in result.stdout


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
