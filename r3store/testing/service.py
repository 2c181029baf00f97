"""Start `r3store-server` in its own process on a free port (benchmarks, examples)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def start_server(
    data_dir: Path, env: Mapping[str, str] | None = None, timeout: float = 30.0
) -> tuple[subprocess.Popen[bytes], str]:
    """The server on the embedded store in `data_dir` (plus `env`); returns it and its URL
    once `/readyz` answers."""
    port = free_port()
    full = {
        **os.environ,
        "R3STORE_PORT": str(port),
        "R3STORE_DATA_DIR": str(data_dir),
        "R3STORE_LOG_LEVEL": "warning",
        **(env or {}),
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "r3store_server.main"],
        env=full,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(process, url, timeout)
    except RuntimeError:
        process.kill()
        raise
    return process, url


def wait_ready(process: subprocess.Popen[bytes], url: str, timeout: float = 30.0) -> None:
    """Return once the server at `url` answers `/readyz`; RuntimeError if it exits or
    stays silent for `timeout` seconds."""
    import httpx  # test and benchmark support only: the library does not need it

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the r3store server exited with {process.returncode}")
        try:
            if httpx.get(f"{url}/readyz", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError("the r3store server did not become ready")


def stop_server(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)
