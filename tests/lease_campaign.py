"""A trainer that crashes, and a server that crashes under it: leases, checkpoints and
resume against a real server process, with retention evicting what was sampled.

The namespace counts each trajectory once (`max_times_sampled=1`) and evicts it then
(`evict_after_sampled`), keeping `keep` checkpoints; maintenance runs every second. The
trajectories are put one at a time, so their FIFO order is the order put. A trainer
(`lease_child.py`) resumes from the last checkpoint its log acknowledges and trains
`steps` steps of `batch` trajectories, checkpointing every `every` steps; each round
SIGKILLs it at a random event (after a lease, a read, a commit, a checkpoint, or during
its resume), and in some rounds SIGKILLs the server first and restarts it on the same
data and port. After each kill, once the next incarnation resumed, the killed one's
last uncommitted lease is committed (a zombie), and a lease and a checkpoint are tried
at its epoch: each must be refused with `Fenced`. A last incarnation then trains to the
end, unkilled.

What must hold (`Tally.failures`): every batch any incarnation trained on is the FIFO
batch of its step (step k: trajectories [(k-1)*batch, k*batch) in the order put) with
the routes written; each trajectory of a trained step was counted once, the rest never;
the routes consumed after the oldest kept checkpoint are still readable, and those
before it were evicted. `tests/test_lease_crash.py` runs it in `make test`, `bench
--only leases` for longer.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

from helpers import SPEC, expected_ids, make_write
from http_helpers import KEYS, ServerProcess
from lease_child import NS, digest
from r3store.errors import Fenced, R3StoreError
from r3store.leases import Lease, LeaseState
from r3store.policy import NamespaceSettings, Retention
from r3store.storage.catalog import Catalog
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import Client, Retry

HERE = Path(__file__).parent
MAINTENANCE = {"R3STORE_MAINTENANCE_INTERVAL": "1", "R3STORE_MAINTENANCE_GRACE": "0"}


@dataclass
class Tally:
    rounds: int = 0
    trainer_kills: int = 0
    server_kills: int = 0
    kills_between_lease_and_commit: int = 0
    kills_during_resume: int = 0
    finished_before_kill: int = 0
    batches_checked: int = 0
    lost: int = 0  # batches with a trajectory uncounted, or whose routes went missing
    double_counted: int = 0  # trajectories counted more than once, or beyond the trained steps
    mismatched: int = 0  # batches not the FIFO batch of their step, or not the routes written
    zombie_commits_refused: int = 0
    zombie_leases_fenced: int = 0  # of those, open when the trainer died: fenced by resume
    zombie_leases_undone: int = 0  # committed by the server, its answer lost: undone
    zombie_commits_accepted: int = 0
    zombie_epoch_calls_refused: int = 0
    zombie_epoch_calls_accepted: int = 0
    evicted: int = 0
    readable_after_oldest_checkpoint: int = 0
    resume_seconds: list[float] = field(default_factory=list)
    restart_seconds: list[float] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)

    def failures(self) -> list[str]:
        bad = [
            f"{name}: {getattr(self, name)}"
            for name in (
                "lost",
                "double_counted",
                "mismatched",
                "zombie_commits_accepted",
                "zombie_epoch_calls_accepted",
            )
            if getattr(self, name)
        ]
        return bad + self.problems

    def summary(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        resumes, restarts = out.pop("resume_seconds"), out.pop("restart_seconds")
        out["resume_median_s"] = statistics.median(resumes) if resumes else None
        out["server_restart_median_s"] = statistics.median(restarts) if restarts else None
        return out


def trajectory_ids(puts: int, size: int) -> list[list[str]]:
    """`puts` uploads of `size` ids each, whose sorted order is not the order put: FIFO
    must follow the time first stored (the ids of one upload are in sorted order, since
    FIFO orders one time's trajectories by id)."""
    return [[f"t{(p * 7919) % 10007:05d}-{j:03d}" for j in range(size)] for p in range(puts)]


class Campaign:
    def __init__(
        self,
        directory: Path,
        rounds: int,
        seed: int = 1,
        batch: int = 8,
        every: int = 3,
        keep: int = 3,
        server_kill_every: int = 5,
        seaweed: SeaweedFS | None = None,
    ) -> None:
        self.directory, self.rounds, self.rng = directory, rounds, random.Random(seed)
        self.batch, self.every, self.keep = batch, every, keep
        self.server_kill_every, self.seaweed = server_kill_every, seaweed
        self.steps = 2 * rounds + 4  # about what the rounds get through
        self.puts = trajectory_ids(self.steps + 4, batch)
        self.order = [t for put in self.puts for t in put]
        self.digests = {t: digest(expected_ids(make_write(t))) for t in self.order}
        self.log = directory / "trainer.log"
        self.tally = Tally()
        self.data = directory / "server"
        self.data.mkdir(parents=True, exist_ok=True)
        self.server = ServerProcess(self.data, seaweed, env=MAINTENANCE)

    def client(self, role: str) -> Client:
        return Client(self.server.url, api_key=KEYS[role], retry=Retry(attempts=3, backoff=0.05))

    def restart_server(self) -> None:
        started = time.perf_counter()
        prefix = getattr(self.server, "prefix", None)
        port = self.server.port
        self.server = ServerProcess(
            self.data, self.seaweed, prefix=prefix, port=port, env=MAINTENANCE
        )
        self.tally.restart_seconds.append(time.perf_counter() - started)

    # setup

    def load(self) -> None:
        settings = NamespaceSettings(
            max_times_sampled=1,
            retention=Retention(evict_after_sampled=True, keep_checkpoints=self.keep),
        )
        with self.client("admin") as admin:
            admin.create_namespace(NS, SPEC, settings)
        with self.client("writer") as writer:
            for put in self.puts:
                writer.put(NS, [make_write(tid) for tid in put])
        with self.client("trainer") as trainer:
            trainer.checkpoint(NS, 0)
        self.log.write_text("CKPT 0\n")

    # the rounds

    def start_trainer(self) -> subprocess.Popen[bytes]:
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]),
        }
        args = [
            self.server.url,
            KEYS["trainer"],
            str(self.log),
            str(self.steps),
            str(self.batch),
            str(self.every),
        ]
        with (self.directory / "trainer.err").open("ab") as err:
            return subprocess.Popen(
                [sys.executable, str(HERE / "lease_child.py"), *args],
                stdout=subprocess.PIPE,
                stderr=err,
                env=env,
            )

    def run(self) -> Tally:
        try:
            self.load()
            for _ in range(self.rounds):
                self.round()
            self.finish()
        finally:
            if self.server.process.poll() is None:
                self.server.kill()
        return self.tally

    def round(self) -> None:
        self.tally.rounds += 1
        resumed = len(self.incarnations())
        child = self.start_trainer()
        try:
            self.kill_at_random(child, resumed)
        finally:
            if child.poll() is None:
                child.kill()
                child.wait()

    def kill_at_random(self, child: subprocess.Popen[bytes], resumed: int) -> None:
        """SIGKILL the trainer at a random event (and the server first, every
        `server_kill_every` rounds); `resumed`: the incarnations the log held before."""
        assert child.stdout is not None
        self.expect(child.stdout, "READY")
        kill_server = self.tally.rounds % self.server_kill_every == 0
        # the event after which it dies: 0 during its resume, else the n-th after it
        events = 0 if self.rng.random() < 0.1 else self.rng.randint(1, 6 * self.every)
        if events:
            self.expect(child.stdout, "RESUMED")
            self.zombies()
        # half the time, it dies as it reads a batch it leased (the lease still open)
        reading = events > 0 and self.rng.random() < 0.5
        finished = False
        for n in itertools.count(1) if events else ():
            line = child.stdout.readline().decode().strip()
            if not line or line == "DONE":
                finished = True
                break
            if n >= events and (not reading or line.startswith("LEASED ")):
                break
        time.sleep(self.rng.uniform(0, 0.003 if reading else 0.01))
        if kill_server and not finished:
            self.server.kill()
            self.tally.server_kills += 1
            time.sleep(self.rng.uniform(0, 0.02))
        if child.poll() is None:
            child.kill()
            self.tally.trainer_kills += 1
        else:
            self.tally.finished_before_kill += 1
        child.wait()
        child.stdout.close()
        if child.returncode not in (0, -9):
            self.tally.problems.append(f"a trainer exited with {child.returncode} by itself")
        if kill_server and not finished:
            self.restart_server()
        runs = self.incarnations()
        kinds = [line.split()[0] for line in runs[-1]]
        if len(runs) == resumed:
            self.tally.kills_during_resume += 1
        elif kinds[-1] in ("LEASE", "STEP"):
            self.tally.kills_between_lease_and_commit += 1

    def expect(self, stream: IO[bytes], word: str) -> None:
        line = stream.readline().decode().strip()
        if not line.startswith(word):
            raise AssertionError(
                f"the trainer said {line!r}, not {word}: see {self.directory / 'trainer.err'}"
            )

    def incarnations(self) -> list[list[str]]:
        """The log's lines, by incarnation (each begins where it resumed, or tried to)."""
        out: list[list[str]] = [[]]
        for line in self.log.read_text().splitlines():
            if line.startswith("RESUMED ") and out[-1]:
                out.append([])
            out[-1].append(line)
        return out

    def zombies(self) -> None:
        """The previous incarnation's last uncommitted lease, and a lease and a checkpoint
        at its epoch: each refused now that a newer incarnation resumed."""
        runs = [r for r in self.incarnations() if r and r[0].startswith("RESUMED ")]
        if len(runs) < 2:
            return
        previous = runs[-2]
        epoch = int(previous[0].split()[2])
        leases = [line for line in previous if line.startswith(("LEASE ", "COMMIT "))]
        with self.client("trainer") as trainer:
            if leases and leases[-1].startswith("LEASE "):
                lease = Lease.from_dict(json.loads(leases[-1].split(" ", 2)[2]))
                state = trainer.get_lease(lease).state
                if state is LeaseState.FENCED:
                    self.tally.zombie_leases_fenced += 1
                elif state is LeaseState.UNDONE:
                    self.tally.zombie_leases_undone += 1
                else:
                    self.tally.problems.append(f"a dead trainer's lease is {state} after resume")
                try:
                    trainer.commit(lease)
                    self.tally.zombie_commits_accepted += 1
                except Fenced:
                    self.tally.zombie_commits_refused += 1
                except R3StoreError as exc:
                    self.tally.problems.append(f"a zombie commit: {exc!r}")
            for call in (
                lambda: trainer.lease(NS, n=self.batch, epoch=epoch),
                lambda: trainer.checkpoint(NS, 10**9, epoch=epoch),
            ):
                try:
                    call()
                    self.tally.zombie_epoch_calls_accepted += 1
                except Fenced:
                    self.tally.zombie_epoch_calls_refused += 1

    # the end

    def finish(self) -> None:
        child = self.start_trainer()
        assert child.stdout is not None
        output = child.stdout.read().decode()
        child.wait()
        child.stdout.close()
        if child.returncode != 0 or "DONE" not in output:
            self.tally.problems.append(f"the last trainer exited with {child.returncode}")
        self.check_log()
        self.check_reads()
        self.server.stop()
        self.check_counts()

    def expected(self, step: int) -> list[str]:
        return self.order[(step - 1) * self.batch : step * self.batch]

    def check_log(self) -> None:
        surviving: dict[int, list[str]] = {}
        for run in self.incarnations():
            for line in run:
                word, *rest = line.split()
                if word == "STEP":
                    step, read = int(rest[0]), [r.split("=") for r in rest[1:]]
                    ids = [tid for tid, _ in read]
                    self.tally.batches_checked += 1
                    if ids != self.expected(step):
                        self.tally.mismatched += 1
                        self.tally.problems.append(f"step {step} trained on {ids[:3]}...")
                    elif any(self.digests[t] != d for t, d in read):
                        self.tally.mismatched += 1
                        self.tally.problems.append(f"step {step} read routes not written")
                    surviving[step] = ids
                elif word == "BAD":
                    self.tally.mismatched += 1
                    self.tally.problems.append(line)
        timeline = [surviving.get(k) for k in range(1, self.steps + 1)]
        if timeline != [self.expected(k) for k in range(1, self.steps + 1)]:
            self.tally.problems.append("the surviving timeline is not the uninterrupted run's")
        for run in self.incarnations():
            if run and run[0].startswith("RESUMED "):
                self.tally.resume_seconds.append(float(run[0].split()[3]))

    def check_reads(self) -> None:
        """Routes consumed after the oldest kept checkpoint read back as written; those
        consumed up to it are evicted (maintenance runs every second)."""
        with self.client("admin") as admin:
            _, kept = admin.checkpoints(NS)
            oldest = min(c.step for c in kept)
            after = [t for k in range(oldest + 1, self.steps + 1) for t in self.expected(k)]
            before = [t for k in range(1, oldest + 1) for t in self.expected(k)]
            deadline = time.monotonic() + 10
            while True:
                gone = admin.get_batch(NS, before).missing if before else []
                if len(gone) == len(before) or time.monotonic() > deadline:
                    break
                time.sleep(0.5)
            self.tally.evicted = len(gone)
            if before and not gone:
                self.tally.problems.append("maintenance evicted nothing that was sampled")
            batch = admin.get_batch(NS, after)
            for tid, item in zip(batch.ids, batch.items, strict=True):
                if item is None:
                    continue
                if item.routes is not None and np.array_equal(
                    item.routes.to_topk(), expected_ids(make_write(tid))
                ):
                    self.tally.readable_after_oldest_checkpoint += 1
                else:
                    self.tally.mismatched += 1
                    self.tally.problems.append(f"{tid} reads back routes not written")
            lost_steps = {
                k
                for k in range(oldest + 1, self.steps + 1)
                for t in self.expected(k)
                if t in set(batch.missing)
            }
            self.tally.lost += len(lost_steps)

    def check_counts(self) -> None:
        """Each trajectory of a trained step counted once (or evicted, having been), the
        rest never; those left are handed out oldest stored first."""
        catalog = Catalog(f"sqlite:///{self.data / 'catalog.db'}")
        try:
            entries = [e for e in catalog.segments.by_versions(NS, 0, 0) if e.start == 0]
        finally:
            catalog.close()
        times = {e.trajectory_id: e.times_sampled for e in entries}
        trained = set(self.order[: self.steps * self.batch])
        lost_steps: set[int] = set()
        for i, tid in enumerate(self.order):
            count = times.get(tid)
            if tid in trained:
                if count == 0:
                    lost_steps.add(i // self.batch + 1)
                elif count is not None and count > 1:
                    self.tally.double_counted += 1
            elif count is None:
                lost_steps.add(i // self.batch + 1)
            elif count != 0:
                self.tally.double_counted += 1
        self.tally.lost += len(lost_steps)
        stored = [e.trajectory_id for e in sorted(entries, key=lambda e: e.created_at)]
        if stored != [t for t in self.order if t in times]:
            self.tally.problems.append("the catalog's first-stored order is not the order put")
