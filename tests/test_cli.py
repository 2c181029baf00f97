"""The admin CLI end to end, on real S3, through its entry point."""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from helpers import eventually, make_write
from r3store.spec import RouteSpec
from r3store.testing.seaweedfs import SeaweedFS
from r3store_server.backends import build_engine
from r3store_server.settings import Settings

SPEC4 = RouteSpec(num_layers=4, num_experts=8, top_k=2)  # the `local` fixture's
SETTINGS = (
    "max_lag",
    "max_times_sampled",
    "keep_versions",
    "ttl",
    "evict_after_sampled",
    "keep_checkpoints",
    "max_open_leases",
    "max_held",
    "max_lease_seconds",
)


@pytest.fixture
def env(tmp_path: Path, seaweed: SeaweedFS, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    store = seaweed.new_store()
    store.close()
    values = {
        "R3STORE_DATA_DIR": str(tmp_path),
        "R3STORE_STORE": "s3",
        "R3STORE_S3__ENDPOINT_URL": seaweed.endpoint_url,
        "R3STORE_S3__BUCKET": store.bucket,
        "R3STORE_S3__PREFIX": store.config.prefix,
        "R3STORE_S3__ACCESS_KEY_ID": seaweed.access_key_id,
        "R3STORE_S3__SECRET_ACCESS_KEY": seaweed.secret_access_key,
    }
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    return values


def cli_json(*args: str, env: dict[str, str] | None = None) -> object:
    """What the CLI prints with `--json`, parsed; it must exit 0."""
    result = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def record(value: object) -> dict[str, Any]:
    """`value`, a JSON object."""
    assert isinstance(value, dict), value
    return value


def records(value: object) -> list[dict[str, Any]]:
    """`value`, a JSON list of objects."""
    assert isinstance(value, list), value
    return [record(item) for item in value]


def cli(*args: str) -> dict[str, Any]:
    """A command's record, with `--json`."""
    return record(cli_json(*args))


def cli_list(*args: str) -> list[dict[str, Any]]:
    """A command's list of records, with `--json`."""
    return records(cli_json(*args))


def test_cli_end_to_end(env: dict[str, str]) -> None:
    # a new bucket prefix and catalog: made only when asked
    made = cli(
        "--init", "namespaces", "create", "run1", "--layers", "4", "--experts", "64", "--top-k", "4"
    )
    assert made["spec"]["num_experts"] == 64
    assert [n["name"] for n in cli_list("namespaces", "list")] == ["run1"]
    engine = build_engine(Settings())
    try:
        engine.put(
            "run1", [make_write(f"t{v}-{i}", policy_version=v) for v in range(3) for i in range(2)]
        )
    finally:
        engine.close()
    stats = cli("stats", "run1")["run1"]
    assert stats["trajectories"] == 6
    assert stats["by_policy_version"] == {"0": 2, "1": 2, "2": 2}
    assert cli("policy", "run1", "--version", "2")["policy_version"] == 2
    settings = cli("settings", "run1", "--keep-versions", "1", "--max-lag", "3")
    assert settings["settings"]["retention"]["keep_versions"] == 1
    report = cli("maintain", "--grace", "0")
    assert report["trajectories_dropped"] == 4
    assert cli("namespaces", "show", "run1")["trajectories"] == 2
    rebuilt = cli("rebuild", "--yes")
    assert rebuilt["trajectories"] == 2
    assert rebuilt["namespaces"] == 1
    assert cli("namespaces", "show", "run1")["policy_version"] == 2
    refused = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "namespaces", "delete", "run1"],
        capture_output=True,
        text=True,
    )
    assert refused.returncode != 0
    assert "--yes" in refused.stderr
    assert cli("namespaces", "delete", "run1", "--yes")["objects_deleted"] >= 2
    missing = subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", "namespaces", "show", "run1"],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 1
    assert "NotFound" in missing.stderr


def test_cli_keys_work_against_the_server(tmp_path: Path) -> None:
    import os

    import httpx

    from http_helpers import ServerProcess

    env = {**os.environ, "R3STORE_DATA_DIR": str(tmp_path)}

    def run(*args: str) -> dict[str, Any]:
        return record(cli_json(*args, env=env))

    def run_list(*args: str) -> list[dict[str, Any]]:
        return records(cli_json(*args, env=env))

    made = run("keys", "create", "trainer", "--role", "reader", "--namespace", "run1")
    key = made["key"]
    assert len(key) >= 32
    listed = run_list("keys", "list")
    assert listed == [
        {"name": "trainer", "role": "reader", "namespaces": ["run1"], "revoked": False}
    ]
    assert key not in json.dumps(listed)
    server = ServerProcess(tmp_path, None)  # its settings keys, plus the catalog's
    try:
        headers = {"Authorization": f"Bearer {key}"}
        assert httpx.get(f"{server.url}/v1/namespaces", headers=headers).status_code == 200
        assert httpx.get(f"{server.url}/metrics", headers=headers).status_code == 403
        run("keys", "revoke", "trainer")
        eventually(  # the server rereads catalog keys every 5 s
            lambda: httpx.get(f"{server.url}/v1/namespaces", headers=headers).status_code == 401,
            "the revoked key refused",
        )
        again = run("keys", "create", "trainer", "--role", "reader")  # a revoked name is free
        assert again["key"] != key
        assert run_list("keys", "list") == [
            {"name": "trainer", "role": "reader", "namespaces": ["*"], "revoked": False}
        ]
        renewed = {"Authorization": f"Bearer {again['key']}"}
        eventually(
            lambda: httpx.get(f"{server.url}/v1/namespaces", headers=renewed).status_code == 200,
            "the new key taken",
        )
        assert httpx.get(f"{server.url}/v1/namespaces", headers=headers).status_code == 401
    finally:
        server.stop()


@pytest.fixture
def local(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The embedded store in `tmp_path`, with one namespace of 4 layers, 8 experts, top-2."""
    monkeypatch.setenv("R3STORE_DATA_DIR", str(tmp_path))
    spec = ("--layers", "4", "--experts", "8", "--top-k", "2")
    cli("--init", "namespaces", "create", "run1", *spec, "--model", "tiny-moe")
    cli("namespaces", "create", "run2", *spec)
    return tmp_path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """The CLI for people: no `--json`."""
    return subprocess.run(
        [sys.executable, "-m", "r3store_server.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_lists_are_aligned_columns_for_people(local: Path) -> None:
    cli("settings", "run1", "--max-lag", "2", "--ttl", "1d")
    listed = run_cli("namespaces", "list")
    assert listed.returncode == 0, listed.stderr
    head, first, second = listed.stdout.splitlines()
    assert head.split() == [
        "NAME", "LAYERS", "EXPERTS", "TOP-K", "POLICY", "MAX-LAG", "KEEP-VERSIONS", "TTL",
        "CREATED", "MODEL",
    ]  # fmt: skip
    assert first.split()[:8] == ["run1", "4", "8", "2", "0", "2", "none", "1d"]
    assert first.endswith(" UTC  tiny-moe")
    assert second.split()[:8] == ["run2", "4", "8", "2", "0", "none", "none", "none"]
    assert head.index("TTL") == first.index("1d") == second.index("none", head.index("TTL"))
    assert "{" not in listed.stdout
    assert [n["name"] for n in cli_list("namespaces", "list")] == ["run1", "run2"]
    cli("keys", "create", "ops", "--role", "admin")
    keys = run_cli("keys", "list").stdout.splitlines()
    assert [line.split() for line in keys] == [
        ["NAME", "ROLE", "NAMESPACES", "REVOKED"],
        ["ops", "admin", "*", "no"],
    ]
    shown = run_cli("namespaces", "show", "run1").stdout
    assert "\n  num_experts: 8\n" in shown
    assert "\n    ttl_seconds: 1d\n" in shown


def test_stats_experts_is_laid_out_per_source_version_and_layer(local: Path) -> None:
    from r3store.records import TrajectoryWrite
    from r3store.testing.synthetic import uniform_topk

    rng = np.random.default_rng(7)
    engine = build_engine(Settings())
    try:
        for version in range(2):
            ids = [f"t{version}-{i}" for i in range(3)]
            topk = [uniform_topk(rng, 40, 4, 8, 2) for _ in ids]
            pairs = list(zip(ids, topk, strict=True))
            engine.put("run1", [TrajectoryWrite(t, 41, topk=k, policy_version=version) for t, k in pairs])  # fmt: skip  # noqa: E501
            engine.put("run1", [TrajectoryWrite(t, 41, topk=k, source="trainer") for t, k in pairs])  # fmt: skip  # noqa: E501
    finally:
        engine.close()
    machine = cli("stats", "run1", "--experts")["run1"]
    assert set(machine["expert_load"]) == {"engine", "trainer"}  # --json unchanged
    assert len(machine["expert_load"]["engine"]["0"]["busiest"]) == 4
    assert machine["agreement"]["engine/trainer"]["1"]["overall"] == 1.0
    assert len(machine["drift"]["0->1"]) == 4
    out = run_cli("stats", "run1", "--experts")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert max(len(line) for line in lines) < 100
    assert "    engine, policy version 0: 123 tokens" in lines
    assert "    trainer, policy version 1: 123 tokens" in lines
    at = lines.index("    engine, policy version 1: 123 tokens")
    assert lines[at + 1].split() == ["LAYER", "IMBALANCE", "BUSIEST", "EXPERTS", "(SHARE)"]
    for layer, line in enumerate(lines[at + 2 : at + 6]):
        number, imbalance, *busiest = line.split()
        assert number == str(layer)
        assert re.fullmatch(r"\d\.\d\d", imbalance)
        assert len(busiest) == 6
        assert all(re.fullmatch(r"\d:|\d+\.\d%,?", b) for b in busiest)
    assert "    engine/trainer, policy version 1: 3 segments, overall 1.000" in lines
    assert "      layers 0-3: 1.000 1.000 1.000 1.000" in lines
    assert "    policy version 0 -> 1:" in lines
    drift = lines[lines.index("    policy version 0 -> 1:") + 1]
    assert re.fullmatch(r"      layers 0-3:( \d\.\d{4}){4}", drift)


def test_ttl_takes_durations_as_they_are_shown(local: Path) -> None:
    def ttl(text: str) -> object:
        return cli("settings", "run1", "--ttl", text)["settings"]["retention"]["ttl_seconds"]

    assert ttl("1d") == 86400
    assert ttl("1d 2h") == 93600
    assert ttl("30m") == 1800
    assert ttl("90s") == 90
    assert ttl("12h") == 43200
    assert ttl("3600") == 3600
    assert ttl("1.5") == 1.5
    assert ttl("none") is None
    shown = run_cli("settings", "run1", "--ttl", "1d 2h 3m 4.5s").stdout
    assert "ttl_seconds: 1d 2h 3m 4.5s" in shown
    for wrong in ("1x", "0", "-60", "d", "1d2", "inf", "1e20"):
        refused = run_cli("settings", "run1", "--ttl", wrong)
        assert refused.returncode == 2
        assert "argument --ttl: expected none or a duration" in refused.stderr, wrong
        assert "Traceback" not in refused.stderr
    helped = run_cli("settings", "--help").stdout
    assert "90s, 30m, 12h, 1d, '1d 2h' or plain" in " ".join(helped.split())


@pytest.mark.parametrize(
    ("option", "value", "accepts"),
    [
        ("--max-lag", "-3", "from 0 to 2^63 - 1"),
        ("--max-lag", "two", "from 0 to 2^63 - 1"),
        ("--max-times-sampled", "0", "from 1 to 2147483647"),
        ("--max-times-sampled", "2147483648", "from 1 to 2147483647"),
        ("--keep-versions", "0", "from 1 to 2^63 - 1"),
    ],
)
def test_settings_out_of_range_say_so_in_one_line(
    local: Path, option: str, value: str, accepts: str
) -> None:
    refused = run_cli("settings", "run1", option, value)
    assert refused.returncode == 2
    [error] = [line for line in refused.stderr.splitlines() if "error" in line]
    assert error == (
        f"r3store settings: error: argument {option}: expected none or a whole number "
        f"{accepts}; got {value!r}"
    )
    assert "validation" not in refused.stderr


def test_a_settings_error_the_parser_let_through_is_one_line() -> None:
    from r3store.policy import NamespaceSettings
    from r3store_server.cli import changed

    given = dict.fromkeys(SETTINGS, None)
    with pytest.raises(ValueError, match=r"^--max-lag") as raised:
        changed(NamespaceSettings(), argparse.Namespace(**{**given, "max_lag": -3}))
    assert str(raised.value) == "--max-lag: input should be greater than or equal to 0 (got -3)"
    with pytest.raises(ValueError, match=r"^--ttl: ") as raised:
        changed(NamespaceSettings(), argparse.Namespace(**{**given, "ttl": float("inf")}))
    assert "\n" not in str(raised.value)


def test_maintain_dry_run_shows_a_pass_and_changes_nothing(env: dict[str, str]) -> None:
    cli("--init", "namespaces", "create", "ns", "--layers", "4", "--experts", "64", "--top-k", "4")
    cli("settings", "ns", "--keep-versions", "1")
    engine = build_engine(Settings())
    try:
        engine.put("ns", [make_write(f"old{i}", policy_version=0) for i in range(3)])
        engine.put("ns", [make_write("new", policy_version=1)])  # version 1 holds routes
    finally:
        engine.close()
    cli("policy", "ns", "--version", "1")
    shown = cli("maintain", "--dry-run", "--grace", "0", "--orphan-age", "0")
    assert shown["dry_run"] is True
    assert shown["drop"] == {"ns": {"trajectories": 3, "first": ["old0", "old1", "old2"]}}
    assert cli("stats", "ns")["ns"]["trajectories"] == 4
    done = cli("maintain", "--grace", "0", "--orphan-age", "0")
    assert done["trajectories_dropped"] == 3


def test_checkpoints_and_leases_commands(local: Path) -> None:
    """`checkpoints list`, `leases`, `checkpoints resume` and `checkpoints delete` on a
    real catalog: what a trainer consumed under leases, checkpointed at steps 10 and 20,
    resumed to step 10."""
    engine = build_engine(Settings())
    try:
        engine.put("run1", [make_write(f"t{i}", SPEC4) for i in range(6)])
        consumption = engine.consumption
        first = consumption.lease("run1", n=2, holder="trainer")
        consumption.commit("run1", first.lease_id)
        consumption.checkpoint("run1", 10)
        second = consumption.lease("run1", n=3, holder="trainer")
        consumption.commit("run1", second.lease_id)
        consumption.checkpoint("run1", 20)
        held = consumption.lease("run1", n=1, holder="trainer", seconds=600)
    finally:
        engine.close()
    listed = cli("checkpoints", "list", "run1")
    assert listed["epoch"] == 0
    assert [(c["step"], c["consumed"], c["epoch"]) for c in listed["checkpoints"]] == [
        (10, 1, 0),
        (20, 2, 0),
    ]
    shown = run_cli("checkpoints", "list", "run1").stdout.splitlines()
    assert shown[:3] == ["namespace: run1", "epoch: 0", "checkpoints:"]
    assert shown[3].split() == ["STEP", "EPOCH", "CONSUMED", "POLICY-VERSION", "CREATED-AT"]
    assert shown[4].split()[:4] == ["10", "0", "1", "0"]
    assert shown[4].endswith(" UTC")
    [lease] = cli("leases", "run1")["leases"]
    assert lease["lease_id"] == held.lease_id
    assert (lease["holder"], lease["size"], lease["epoch"]) == ("trainer", 1, 0)
    assert 0 < lease["expires_in_seconds"] <= 600
    people = run_cli("leases", "run1").stdout.splitlines()
    assert people[3].split()[:4] == ["LEASE-ID", "HOLDER", "SIZE", "EPOCH"]
    assert people[4].split()[:4] == [held.lease_id, "trainer", "1", "0"]
    assert re.search(r"\b9m \d+(\.\d)?s$|\b10m$", people[4]), people[4]

    refused = run_cli("checkpoints", "resume", "run1", "10")
    assert refused.returncode == 1
    assert "--yes" in refused.stderr
    assert cli("checkpoints", "list", "run1")["epoch"] == 0
    done = cli("checkpoints", "resume", "run1", "10", "--yes")
    assert done == {
        "namespace": "run1",
        "step": 10,
        "epoch": 1,
        "policy_version": 0,
        "leases_undone": 1,
        "samplings_undone": 3,
        "leases_fenced": 1,
        "checkpoints_dropped": [20],
    }
    assert cli("leases", "run1") == {"namespace": "run1", "epoch": 1, "leases": []}
    assert run_cli("leases", "run1").stdout.splitlines()[2] == "leases: none"
    again = run_cli("checkpoints", "resume", "run1", "20", "--yes")
    assert again.returncode == 1
    assert "no checkpoint at step 20 in namespace 'run1' (it has: 10)" in again.stderr
    assert cli("checkpoints", "delete", "run1", "10") == {
        "namespace": "run1",
        "step": 10,
        "deleted": True,
    }
    assert cli("checkpoints", "list", "run1")["checkpoints"] == []
    assert "checkpoints: none" in run_cli("checkpoints", "list", "run1").stdout


def test_checkpoint_and_lease_commands_refuse_clearly(local: Path) -> None:
    for args in (
        ("checkpoints", "list", "nothing"),
        ("checkpoints", "delete", "nothing", "1"),
        ("checkpoints", "resume", "nothing", "1", "--yes"),
        ("leases", "nothing"),
    ):
        refused = run_cli(*args)
        assert refused.returncode == 1, args
        assert refused.stderr.splitlines()[-1] == "r3store: NotFound: no namespace 'nothing'"
    missing = run_cli("checkpoints", "delete", "run1", "5")
    assert missing.returncode == 1
    assert "no checkpoint at step 5 in namespace 'run1'" in missing.stderr
    for wrong in ("-1", "two", str(2**63)):
        bad = run_cli("checkpoints", "resume", "run1", wrong, "--yes")
        assert bad.returncode == 2
        assert "argument step: expected a step, a whole number from 0 to 2^63 - 1" in bad.stderr
        assert "Traceback" not in bad.stderr


def test_keep_checkpoints_is_a_setting(local: Path) -> None:
    def kept(*value: str) -> object:
        answer = cli("settings", "run1", *value)
        return answer["settings"]["retention"]["keep_checkpoints"]

    assert kept() == 3  # the default, unchanged by a settings call that names nothing
    assert kept("--keep-checkpoints", "5") == 5
    assert kept("--max-lag", "2") == 5  # kept when another option changes
    assert kept("--keep-checkpoints", "none") is None
    refused = run_cli("settings", "run1", "--keep-checkpoints", "0")
    assert refused.returncode == 2
    assert "argument --keep-checkpoints: expected none or a whole number from 1" in refused.stderr
    assert kept("--keep-checkpoints", "2") == 2
    engine = build_engine(Settings())
    try:
        for step in (1, 2, 3):
            engine.consumption.checkpoint("run1", step)
    finally:
        engine.close()
    steps = [c["step"] for c in cli("checkpoints", "list", "run1")["checkpoints"]]
    assert steps == [2, 3]
