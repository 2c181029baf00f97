"""What importing each part loads: a trainer importing the client loads no database, S3
or web framework; the replay modules not even the HTTP client; the CLI no web app.
(`make lint` enforces the import contracts statically; this checks what really loads.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ["sqlalchemy", "boto3", "botocore", "fastapi", "starlette", "uvicorn", "httpx", "torch"]
# r3store's own I/O: the object stores, the shard builder (and pyarrow's Parquet), the
# catalog and the engine
STORAGE = ["r3store.storage", "r3store.engine", "pyarrow.parquet"]


def loaded(code: str) -> set[str]:
    probe = f"import sys\n{code}\nimport json\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120
    )
    modules = set(json.loads(out.stdout.splitlines()[-1]))
    return {name for name in HEAVY + STORAGE if name in modules}


@pytest.mark.parametrize(
    ("code", "allowed"),
    [
        (
            "from r3store_client import Client, RolloutWriter\nimport r3store_client.convert",
            {"httpx"},
        ),
        ("import r3store_client.replay\nimport r3store_client.tensors", {"torch"}),
        ("import r3store_client.megatron", {"torch"}),
        ("import r3store.protocol.wire, r3store.protocol.models, r3store.records", set()),
        ("import r3store_server.cli", {"sqlalchemy", "boto3", "botocore", *STORAGE}),
    ],
    ids=["client", "replay", "megatron", "wire", "cli"],
)
def test_imports_load_only_what_they_need(code: str, allowed: set[str]) -> None:
    assert loaded(code) <= allowed


def test_every_package_is_installed() -> None:
    """A wheel holds the packages pyproject lists, not those it finds: each folder with an
    `__init__.py` must be listed, or a non-editable install (the Docker image) lacks it."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parent.parent
    listed = set(
        tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    folders = {
        "r3store": root,
        "r3store_server": root / "server",
        "r3store_client": root / "client",
    }
    found = {
        ".".join(init.parent.relative_to(base).parts)
        for package, base in folders.items()
        for init in (base / package).rglob("__init__.py")
    }
    assert found == listed
