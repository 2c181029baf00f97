"""Start `r3store-server` in its own process on a free port (benchmarks, examples), and
send it a request again while it answers 429."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any


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


def post_until_admitted(
    url: str, path: str, seconds: float, timeout: float, **request: Any
) -> list[int]:
    """POST `request` (httpx's arguments) to `path` again while the server at `url`
    answers 429 (no room now), as the clients do, for `seconds` at most: the status of
    each try, the last one's final."""
    import httpx  # test and benchmark support only: the library does not need it

    statuses: list[int] = []
    deadline = time.monotonic() + seconds
    with httpx.Client(base_url=url, timeout=timeout) as http:
        while not statuses or (statuses[-1] == 429 and time.monotonic() < deadline):
            statuses.append(http.post(path, **request).status_code)
            time.sleep(0.05 * (statuses[-1] == 429))
    return statuses
