"""Peak resident memory of a process that ingests 4 GiB of routes through the engine."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.figures import Figure

GIB = 1 << 30


def high_water_mark() -> int:
    """Peak resident bytes of this process since it started (`VmHWM`, reset by exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def child(directory: str, total_bytes: int) -> None:
    from r3store.engine import Engine
    from r3store.records import TrajectoryWrite
    from r3store.spec import RouteSpec
    from r3store.storage.catalog import Catalog
    from r3store.storage.store import LocalStore
    from r3store.testing.synthetic import uniform_topk

    spec = RouteSpec(48, 128, 8)
    tokens = 4096
    pool = [
        uniform_topk(np.random.default_rng(i), tokens - 1, 48, 128, 8, np.uint8) for i in range(8)
    ]
    per = pool[0].nbytes
    count = total_bytes // per
    before = high_water_mark()
    engine = Engine(LocalStore(Path(directory) / "objects"), Catalog(f"sqlite:///{directory}/c.db"))
    engine.namespaces.create("mem", spec)
    start = time.perf_counter()

    def put(i: int) -> None:
        engine.put("mem", [TrajectoryWrite(f"t{i}", tokens, topk=pool[i % len(pool)])])

    with ThreadPoolExecutor(8) as threads:
        list(threads.map(put, range(count)))
    seconds = time.perf_counter() - start
    engine.close()
    peak = high_water_mark()
    print(json.dumps({"peak": peak, "before": before, "bytes": count * per, "seconds": seconds}))


def run(total_bytes: int = 4 * GIB) -> list[Figure]:
    with tempfile.TemporaryDirectory(prefix="r3store-mem-") as directory:
        out = subprocess.run(
            [sys.executable, "-m", "bench.memory_bench", directory, str(total_bytes)],
            check=True,
            capture_output=True,
            text=True,
        )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    gib = result["bytes"] / GIB
    return [
        Figure(
            f"peak RSS ingesting {gib:.1f} GiB of uint8 routes",
            result["peak"] / 2**20,
            "MiB",
            None,
            None,
            "< 1024 MiB",
        ),
        Figure(
            "  of which before ingest (interpreter, libraries, input pool)",
            result["before"] / 2**20,
            "MiB",
        ),
        Figure(
            "  ingest rate during the memory run",
            result["bytes"] / result["seconds"] / 8 / 1e6,
            "M token-layers/s",
        ),
    ]


if __name__ == "__main__":
    child(sys.argv[1], int(sys.argv[2]))
