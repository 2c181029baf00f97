"""Every code block of the README is run here, is an excerpt of a file that runs, or is
marked illustrative (`<!-- illustrative -->` on the line before it)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from r3store.testing.service import start_server, stop_server

ROOT = Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
MARKED = re.compile(
    r"<!-- (illustrative|test: [\w-]+|excerpt: \S+) -->\n```\w*\n(.*?)^```", re.S | re.M
)
TESTED = {"curl", "cli", "engine"}  # the blocks the tests below run


def marked() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in MARKED.finditer(README)]


def block(name: str) -> str:
    [code] = [code for marker, code in marked() if marker == f"test: {name}"]
    return code


def test_every_block_is_run_or_marked_illustrative() -> None:
    assert len(FENCE.findall(README)) == len(marked()), "a README code block has no marker"
    tested = {marker.removeprefix("test: ") for marker, _ in marked() if marker.startswith("test")}
    assert tested == TESTED


def test_excerpts_are_in_their_files() -> None:
    excerpts = [(m.removeprefix("excerpt: "), c) for m, c in marked() if m.startswith("excerpt")]
    assert excerpts
    for path, code in excerpts:
        assert code in (ROOT / path).read_text(), f"the README's excerpt of {path} differs"


def test_curl_walkthrough(tmp_path: Path) -> None:
    server, url = start_server(tmp_path)
    try:
        script = block("curl").replace("localhost:8330", url.removeprefix("http://"))
        out = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", script.replace("curl -s", "curl -sf")],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    finally:
        stop_server(server)
    answers = [json.loads(line) for line in out.replace("}{", "}\n{").splitlines()]
    assert answers[0] == {"status": "ok", "detail": None}
    assert answers[1]["spec"]["num_layers"] == 48
    assert answers[-1]["policy_version"] == 1
    assert answers[-1]["trajectories"] == 0


def run_cli_block(where: Path) -> subprocess.CompletedProcess[str]:
    (where / "data").mkdir()  # where `make serve` keeps its store
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env = {k: v for k, v in env.items() if not k.startswith("R3STORE_")}
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block("cli")],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result


def test_cli_block(tmp_path: Path) -> None:
    result = run_cli_block(tmp_path)
    assert "store local directory" in result.stderr
    assert str(tmp_path / "data" / "objects") in result.stderr
    assert "max_policy_lag" in result.stdout
    assert '"trajectories": 0' in result.stdout  # the stats block, as JSON
    assert "namespaces: 1" in result.stdout  # the rebuild found the namespace again


def run_engine_block() -> None:
    scope: dict[str, object] = {}
    exec(compile(block("engine"), "README.md", "exec"), scope)
    routes = scope["routes"]
    assert isinstance(routes, np.ndarray)
    assert routes.shape == (4096, 48, 8)
    assert (routes[-1] == -1).all()


def test_engine_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    os.makedirs("data")
    run_engine_block()


def test_engine_block_after_the_cli_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Read in order, the README runs the command line's block on the store in `data/`
    and then the engine's on the same store: it must not trip over the namespace the
    command line configured; run again, it is acknowledged again."""
    run_cli_block(tmp_path)
    monkeypatch.chdir(tmp_path)
    run_engine_block()
    run_engine_block()
