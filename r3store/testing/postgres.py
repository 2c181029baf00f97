"""Start a throwaway PostgreSQL server (Debian's package) on a free port, for tests.

PostgreSQL refuses to run as root, so as root the cluster is made and run as the
`postgres` user (which the Debian package creates).
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path


def _bin(name: str) -> str:
    found = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    if found:
        return found[-1]
    path = shutil.which(name)
    if path is None:
        raise RuntimeError(f"PostgreSQL's {name} is missing: apt-get install postgresql")
    return path


def _as_postgres(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@dataclass
class Postgres:
    port: int
    workdir: Path

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def database(self, name: str) -> str:
        """A fresh database; returns its SQLAlchemy URL."""
        subprocess.run(
            _as_postgres(
                [_bin("createdb"), "-h", "127.0.0.1", "-p", str(self.port), "-U", "postgres", name]
            ),
            check=True,
            capture_output=True,
        )
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/{name}"

    def allow_connections(self, name: str, allowed: bool) -> None:
        """Let a database take connections, or refuse them and drop those it has: an
        outage of that database, with the server still up."""
        import sqlalchemy as sa

        admin = sa.create_engine(self.url, isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(
                    sa.text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS {str(allowed).lower()}')
                )
                if not allowed:
                    conn.execute(
                        sa.text(
                            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                            "WHERE datname = :name"
                        ),
                        {"name": name},
                    )
        finally:
            admin.dispose()

    def stop(self) -> None:
        subprocess.run(
            _as_postgres(
                [_bin("pg_ctl"), "-D", str(self.workdir / "data"), "-m", "immediate", "stop"]
            ),
            capture_output=True,
        )
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(timeout: float = 60.0) -> Postgres:
    workdir = Path(tempfile.mkdtemp(prefix="r3store-pg-"))
    os.chmod(workdir, 0o777)
    if os.geteuid() == 0:
        shutil.chown(workdir, "postgres", "postgres")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = workdir / "data"
    subprocess.run(
        _as_postgres(
            [_bin("initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "-E", "UTF8"]
        ),
        check=True,
        capture_output=True,
    )
    options = f"-p {port} -k {workdir} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        _as_postgres(
            [
                _bin("pg_ctl"),
                "-D",
                str(data),
                "-o",
                options,
                "-l",
                str(workdir / "log"),
                "-w",
                "start",
            ]
        ),
        check=True,
        capture_output=True,
        timeout=timeout,
    )
    server = Postgres(port, workdir)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return server
        time.sleep(0.2)
    server.stop()
    raise RuntimeError("PostgreSQL did not start")


@contextmanager
def running() -> Iterator[Postgres]:
    server = start()
    try:
        yield server
    finally:
        server.stop()
