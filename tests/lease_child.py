"""A trainer incarnation for `lease_campaign`: resume from its last acknowledged
checkpoint, then train steps on FIFO leases until told to stop (or SIGKILLed).

    python lease_child.py URL KEY LOG STEPS BATCH EVERY

Its checkpoint directory is LOG, appended to and fsynced before each next action:
`RESUMED step epoch seconds`, `LEASE k <lease json>`, `STEP k id=digest...` (the batch
read, each trajectory's routes digested), `COMMIT k`, `CKPT k` (acknowledged), `BAD k
why`, `DONE`. Progress goes to stdout, one line per event, for the parent to time its
kill.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import numpy as np

from r3store.leases import Lease
from r3store_client import Client, Retry

NS = "leases"


def last_checkpoint(log: str) -> int:
    """The last checkpoint step the log acknowledges (0: the one made before training)."""
    step = 0
    for line in log.splitlines():
        if line.startswith("CKPT "):
            step = int(line.split()[1])
    return step


class Log:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, line: str) -> None:
        os.write(self.fd, (line + "\n").encode())
        os.fsync(self.fd)


def say(event: str) -> None:
    print(event, flush=True)


def digest(topk: np.ndarray) -> str:
    """What the parent compares with the routes it wrote (`lease_campaign`)."""
    ids = np.ascontiguousarray(topk, dtype=np.int16)
    return hashlib.sha256(repr(ids.shape).encode() + ids.tobytes()).hexdigest()[:16]


def read_ranks(client: Client, lease: Lease) -> tuple[list[str], str | None]:
    """Read the lease as two data-parallel ranks: `id=digest` of each trajectory, and
    why the reads are wrong (missing, or not the lease's slices), or None."""
    got: list[str] = []
    ids: list[str] = []
    for rank in range(2):
        batch = client.read_lease(lease, rank, 2)
        if batch.missing or batch.stale:
            return got, f"rank {rank}: missing {batch.missing} stale {batch.stale}"
        for tid, item in zip(batch.ids, batch.items, strict=True):
            if item is None or item.routes is None:
                return got, f"rank {rank}: no routes for {tid}"
            got.append(f"{tid}={digest(item.routes.to_topk())}")
        ids += batch.ids
    if ids != list(lease.trajectory_ids):
        return got, f"the ranks' slices {ids} are not the lease {list(lease.trajectory_ids)}"
    return got, None


def main() -> int:
    url, key, log_path, steps, size, every = sys.argv[1:7]
    total, batch_size, every_n = int(steps), int(size), int(every)
    with open(log_path, "rb") as f:
        step = last_checkpoint(f.read().decode())
    log = Log(log_path)
    client = Client(url, api_key=key, retry=Retry(attempts=3, backoff=0.05))
    say("READY")
    started = time.perf_counter()
    done = client.resume(NS, step)
    log.write(f"RESUMED {step} {done.epoch} {time.perf_counter() - started:.6f}")
    say(f"RESUMED {step}")
    if done.policy_version != step:
        log.write(f"BAD {step} resumed to policy version {done.policy_version}, not {step}")
        return 1
    for k in range(step + 1, total + 1):
        lease = client.lease(NS, n=batch_size, seconds=120, epoch=done.epoch)
        log.write(f"LEASE {k} {json.dumps(lease.to_dict())}")
        say(f"LEASED {k}")
        read, why = read_ranks(client, lease)
        log.write(f"STEP {k} {' '.join(read)}")
        if why is not None:
            log.write(f"BAD {k} {why}")
            return 1
        say(f"READ {k}")
        client.commit(lease)
        log.write(f"COMMIT {k}")
        say(f"COMMITTED {k}")
        client.set_policy_version(NS, k)
        if k % every_n == 0:
            client.checkpoint(NS, k, epoch=done.epoch)
            log.write(f"CKPT {k}")
            say(f"CKPT {k}")
    log.write("DONE")
    say("DONE")
    return 0


if __name__ == "__main__":
    sys.exit(main())
