"""What a new user meets first: configuration errors, the command line, /docs, keys,
logs, and the files a package should carry."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import httpx
import pytest

import r3store
from http_helpers import ServerProcess
from r3store.testing.service import start_server, stop_server
from r3store_server.cli import parser as cli_parser
from r3store_server.settings import variables

ROOT = Path(__file__).parent.parent
CREATE = ("--init", "namespaces", "create", "run1", "--layers", "4", "--experts", "8")
CREATE += ("--top-k", "2")
BIN = Path(sys.executable).parent


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("R3STORE_")}
    return {**env, **extra}


def server(
    env: dict[str, str], *args: str, timeout: float = 30
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "r3store_server.main", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def cli(
    cwd: Path, *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(BIN / "r3store"), *args],
        cwd=cwd,
        env=env or clean_env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("R3STORE_PORT", "abc", "an integer >= 0, <= 65535"),
        ("R3STORE_LOG_LEVEL", "loud", "one of debug, info, warning, error, critical"),
        ("R3STORE_API_KEYS", "not json", "not valid JSON"),
        ("R3STORE_API_KEYS_FILE", "/nonexistent/keys.json", "an existing file"),
        ("R3STORE_CATALOG_URL", "no-database", "not a database URL"),
        ("R3STORE_S3__READ_TIMEOUT", "-1", "a number > 0"),
        ("R3STORE_STORE", "disk", "one of local, s3"),
    ],
)
def test_a_bad_setting_is_one_line_naming_the_variable(
    tmp_path: Path, variable: str, value: str, says: str
) -> None:
    result = server(clean_env(R3STORE_DATA_DIR=str(tmp_path), **{variable: value}))
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(f"r3store-server: {variable}")
    assert says in lines[0]
    assert result.stdout == ""
    assert not (tmp_path / "catalog.db").exists()


def test_a_typo_is_warned_and_a_busy_port_named_before_anything_is_logged(
    tmp_path: Path,
) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        result = server(
            clean_env(
                R3STORE_DATA_DIR=str(tmp_path),
                R3STORE_PORT=str(port),
                R3STORE_PROT="1",
                R3STORE_URL="http://127.0.0.1:8330",  # the client's, as the examples export
                R3STORE_KEY="a-client-key",
            )
        )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert lines[0] == "r3store-server: warning: R3STORE_PROT is not a setting (a typo?)"
    assert lines[1] == (
        f"r3store-server: 127.0.0.1:{port} is already in use: set R3STORE_PORT to a free "
        "port (or stop the other server)"
    )
    assert len(lines) == 2


def test_help_and_version_start_no_server(tmp_path: Path) -> None:
    shown = server(clean_env(R3STORE_DATA_DIR=str(tmp_path)), "--help", timeout=15)
    assert shown.returncode == 0
    for name in variables():
        assert name in shown.stdout
    assert not (tmp_path / "catalog.db").exists()
    for command in ([sys.executable, "-m", "r3store_server.main"], [str(BIN / "r3store")]):
        version = subprocess.run([*command, "--version"], capture_output=True, text=True)
        assert version.stdout.strip() == f"r3store {r3store.__version__}"
    assert re.fullmatch(r"\d+\.\d+\.\d+", r3store.__version__)


def test_every_cli_option_has_help() -> None:
    def check(p: object, where: str) -> None:
        for action in p._actions:  # type: ignore[attr-defined]
            if action.dest in ("help", "version"):
                continue
            if action.choices and isinstance(action.choices, dict):  # sub-commands
                for name, sub in action.choices.items():
                    check(sub, f"{where} {name}")
                continue
            assert action.help, f"{where}: {action.option_strings or action.dest} has no help"

    check(cli_parser(), "r3store")


def test_cli_refuses_to_make_an_empty_store_and_says_which_it_opens(tmp_path: Path) -> None:
    refused = cli(tmp_path, "namespaces", "list")
    assert refused.returncode == 2
    assert "no store at" in refused.stderr
    assert "--init" in refused.stderr
    assert not (tmp_path / "data").exists()
    made = cli(tmp_path, *CREATE)
    assert made.returncode == 0, made.stderr
    assert f"store local directory {tmp_path / 'data' / 'objects'}" in made.stderr
    assert f"catalog sqlite:///{tmp_path / 'data' / 'catalog.db'}" in made.stderr
    assert re.search(r"created_at: \d{4}-\d\d-\d\d \d\d:\d\d:\d\d UTC", made.stdout)
    listed = cli(tmp_path, "namespaces", "list")  # the store now exists: no --init needed
    assert listed.returncode == 0
    assert "run1" in listed.stdout
    maintained = cli(tmp_path, "maintain")
    assert maintained.returncode == 0
    assert "[#" not in maintained.stderr  # no progress bar when stderr is not a terminal


LEASING = {"max_open": 1024, "max_held": None, "max_seconds": 86400.0}  # the defaults


def test_cli_settings_change_only_what_is_given(tmp_path: Path) -> None:
    def settings(*args: str) -> dict[str, object]:
        result = cli(tmp_path, "--json", "settings", "run1", *args)
        assert result.returncode == 0, result.stderr
        value: dict[str, object] = json.loads(result.stdout)["settings"]
        return value

    cli(tmp_path, *CREATE)
    assert settings("--max-lag", "3", "--ttl", "60") == {
        "max_policy_lag": 3,
        "max_times_sampled": None,
        "retention": {
            "keep_versions": None,
            "ttl_seconds": 60.0,
            "evict_after_sampled": False,
            "keep_checkpoints": 3,
        },
        "leasing": LEASING,
        "read_sources": ["predicted", "engine"],
    }
    after = settings("--keep-versions", "2", "--max-times-sampled", "5", "--evict-after-sampled")
    assert after == {
        "max_policy_lag": 3,
        "max_times_sampled": 5,
        "retention": {
            "keep_versions": 2,
            "ttl_seconds": 60.0,
            "evict_after_sampled": True,
            "keep_checkpoints": 3,
        },
        "leasing": LEASING,
        "read_sources": ["predicted", "engine"],
    }
    assert settings() == after  # nothing given: nothing changes
    cleared = settings("--max-lag", "none", "--ttl", "none", "--no-evict-after-sampled")
    assert cleared == {
        "max_policy_lag": None,
        "max_times_sampled": 5,
        "retention": {
            "keep_versions": 2,
            "ttl_seconds": None,
            "evict_after_sampled": False,
            "keep_checkpoints": 3,
        },
        "leasing": LEASING,
        "read_sources": ["predicted", "engine"],
    }
    limited = settings("--max-open-leases", "4", "--max-held", "100", "--max-lease-seconds", "1h")
    assert limited["leasing"] == {"max_open": 4, "max_held": 100, "max_seconds": 3600.0}
    assert settings("--max-held", "none")["leasing"]["max_held"] is None  # type: ignore[index]


def test_docs_work_offline_and_declare_the_key_schemes(tmp_path: Path) -> None:
    process, url = start_server(tmp_path)
    try:
        page = httpx.get(f"{url}/docs")
        assert page.status_code == 200
        assert not re.search(r"(src|href)=['\"]?(https?:)?//", page.text), "an asset from afar"
        assets = re.findall(r"(?:src|href)=['\"]?(/docs/assets/[^'\" >]+)", page.text)
        assert any(a.endswith("swagger-ui-bundle.js") for a in assets)
        assert any(a.endswith("swagger-ui.css") for a in assets)
        for asset in assets:
            answer = httpx.get(f"{url}{asset}")
            assert answer.status_code == 200, asset
            assert len(answer.content) > 100, asset
        schema = httpx.get(f"{url}/openapi.json").json()
    finally:
        stop_server(process)
    schemes = schema["components"]["securitySchemes"]
    assert schemes["APIKeyHeader"] == {
        "type": "apiKey",
        "in": "header",
        "name": "X-API-Key",
        "description": "an r3store API key",
    }
    assert schemes["HTTPBearer"]["scheme"] == "bearer"
    upload = schema["paths"]["/v1/namespaces/{namespace}/trajectories"]["post"]
    assert {"APIKeyHeader": []} in upload["security"]
    assert {"HTTPBearer": []} in upload["security"]
    assert "security" not in schema["paths"]["/healthz"]["get"]


def test_a_key_created_while_auth_is_off_turns_it_on_without_a_restart(tmp_path: Path) -> None:
    process, url = start_server(tmp_path)
    try:
        assert httpx.get(f"{url}/v1/namespaces").status_code == 200  # off: no key needed
        made = cli(
            tmp_path,
            "--json",
            "keys",
            "create",
            "ops",
            "--role",
            "admin",
            env=clean_env(R3STORE_DATA_DIR=str(tmp_path)),
        )
        assert made.returncode == 0, made.stderr
        key = json.loads(made.stdout)["key"]
        deadline = time.monotonic() + 15
        while httpx.get(f"{url}/v1/namespaces").status_code == 200:
            assert time.monotonic() < deadline, "authentication did not turn on"
            time.sleep(0.2)
        assert httpx.get(f"{url}/v1/namespaces").status_code == 401
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{url}/v1/namespaces", headers=headers).status_code == 200
    finally:
        stop_server(process)


def test_readable_logs_with_client_addresses_and_maintenance_passes(tmp_path: Path) -> None:
    from helpers import make_write
    from http_helpers import KEYS
    from r3store.policy import NamespaceSettings, Retention
    from r3store.spec import RouteSpec
    from r3store_client import Client

    proc = ServerProcess(
        tmp_path,
        None,
        env={
            "R3STORE_LOG_JSON": "false",
            "R3STORE_MAINTENANCE_INTERVAL": "0.5",
            "R3STORE_MAINTENANCE_GRACE": "0",
            "R3STORE_LOG_LEVEL": "info",
        },
    )
    try:
        with Client(proc.url, api_key=KEYS["admin"]) as client:
            keep_one = NamespaceSettings(retention=Retention(keep_versions=1))
            client.create_namespace("ns", RouteSpec(4, 64, 4), keep_one)
            client.put("ns", [make_write("old", policy_version=0)])
            client.set_policy_version("ns", 1)
            client.put("ns", [make_write("new", policy_version=1)])  # version 0 is now older
            deadline = time.monotonic() + 20
            while client.namespace("ns").trajectories != 1:
                assert time.monotonic() < deadline, "retention did not run"
                time.sleep(0.2)
            time.sleep(0.5)
    finally:
        proc.stop()
    log = (tmp_path / f"server-{proc.port}.log").read_text()
    assert not any(line.startswith("{") for line in log.splitlines())
    assert re.search(
        r"^\S+Z INFO +request POST /v1/namespaces 201 [\d.]+ ms client=127\.0\.0\.1:\d+ \[\w+\]$",
        log,
        re.M,
    ), log
    passes = [line for line in log.splitlines() if " maintenance " in f"{line} "]
    assert passes, log
    assert "trajectories_dropped=1" in passes[0], log


def test_reader_without_torch_says_what_to_install() -> None:
    code = "import sys; sys.modules['torch'] = None; import r3store_client.reader"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode != 0
    assert (
        "ImportError: r3store_client.reader needs torch, which is not installed: "
        "pip install 'r3store[torch]'"
    ) in result.stderr


def test_license_typed_markers_and_a_lean_service() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "Apache-2.0"
    assert (
        "Apache License\n                           Version 2.0" in (ROOT / "LICENSE").read_text()
    )
    assert project["project"]["license-files"] == ["LICENSE"]
    assert project["tool"]["setuptools"]["package-data"] == {"*": ["py.typed"]}
    for package in ("r3store", "server/r3store_server", "client/r3store_client"):
        assert (ROOT / package / "py.typed").exists()
    # the service's own dependencies: no torch, no model or test libraries
    runtime = " ".join(project["project"]["dependencies"])
    for heavy in ("torch", "transformers", "megatron", "pytest", "psycopg"):
        assert heavy not in runtime
    make = (ROOT / "Makefile").read_text()
    serve = re.search(r"^serve: (.*)$", make, re.M)
    assert serve
    assert serve.group(1).split() == ["$(SERVE_STAMP)"]
    stamp = make[make.index("$(SERVE_STAMP): ") :].split("\n\n")[0]
    assert "pip install --quiet -e .\n" in stamp
    assert "apt-get" not in stamp
    assert "TORCH ?= torch==2.13.0+cpu" in make  # the CPU build, by name
