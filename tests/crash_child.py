"""Writes trajectories in a loop until killed; prints `ACK <unit>` after each put returns.

Usage: crash_child.py DATA_DIR FIRST_UNIT [S3_ENDPOINT BUCKET PREFIX KEY SECRET]
"""

from __future__ import annotations

import contextlib
import sys
import threading
from pathlib import Path

from helpers import SPEC, make_write
from r3store.engine import Engine, EngineConfig
from r3store.engine.writer import WriterConfig
from r3store.errors import Conflict
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore, ObjectStore, S3Config, S3Store

UNIT = 3  # trajectories per put


def main() -> None:
    data, first = Path(sys.argv[1]), int(sys.argv[2])
    store: ObjectStore
    if len(sys.argv) > 3:
        endpoint, bucket, prefix, key, secret = sys.argv[3:8]
        store = S3Store(
            S3Config(bucket, endpoint, prefix=prefix, access_key_id=key, secret_access_key=secret)
        )
    else:
        store = LocalStore(data / "objects")
    engine = Engine(
        store,
        Catalog(f"sqlite:///{data / 'catalog.db'}"),
        EngineConfig(writer=WriterConfig(commit_interval=0.01)),
    )
    with contextlib.suppress(Conflict):
        engine.namespaces.create("ns", SPEC)
    out = threading.Lock()
    counter = iter(range(first, first + 10**9, 1))
    take = threading.Lock()

    def loop() -> None:
        while True:
            with take:
                unit = next(counter)
            writes = [make_write(f"u{unit}-{i}", group_id=f"u{unit}") for i in range(UNIT)]
            engine.put("ns", writes)
            with out:
                sys.stdout.write(f"ACK u{unit}\n")
                sys.stdout.flush()

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    sys.stdout.write("READY\n")
    sys.stdout.flush()
    for t in threads:
        t.join()


if __name__ == "__main__":
    main()
