"""The rollout writer: queue trajectories, send them in the background in batches.

    with RolloutWriter(client, "run1") as writer:
        for out in engine_outputs:
            writer.write(from_sglang(out.id, out.meta_info, out.total_tokens, 48, 8))
    # leaving the block flushes; writer.report says what was sent and what was not

Memory is bounded by `max_pending_bytes`: `write` then blocks (or raises `Backpressure`
with `block=False`). A batch the server refuses as bad input is sent again trajectory by
trajectory, so one bad trajectory does not sink the others; those refused are reported.
While the server is unreachable the writer keeps its batch and retries with backoff;
uploads are idempotent, so nothing is stored twice. The first failure of a run of them
is logged as a WARNING (each retry after it at INFO), and so is the recovery, with how
long uploads failed and how many attempts failed. Whatever is still unsent when
`close(timeout)` gives up is reported, never dropped silently.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from r3store.errors import Backpressure, InvalidInput, R3StoreError, StoreError
from r3store.records import TrajectoryWrite
from r3store_client.client import Client

log = logging.getLogger("r3store.client")


@dataclass
class WriterReport:
    sent: int = 0  # acknowledged by the server (stored, or stored already)
    failed: dict[str, str] = field(default_factory=dict)  # refused: id -> reason
    unsent: list[str] = field(default_factory=list)  # still queued when closed


def _nbytes(write: TrajectoryWrite) -> int:
    routes = write.topk if write.topk is not None else write.mask
    return int(np.asarray(routes).nbytes) + 256


class RolloutWriter:
    def __init__(
        self,
        client: Client,
        namespace: str,
        *,
        batch_size: int = 16,
        batch_bytes: int = 32 << 20,
        max_pending_bytes: int = 512 << 20,
        linger: float = 0.05,
        retry_backoff: float = 0.5,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.max_pending_bytes = max_pending_bytes
        self.linger = linger
        self.retry_backoff = retry_backoff
        self.report = WriterReport()
        self._queue: deque[tuple[TrajectoryWrite, int]] = deque()
        self._pending_bytes = 0
        self._inflight = 0
        self._cond = threading.Condition()
        self._closing = False
        self._deadline: float | None = None
        self._failing_since: float | None = None  # when uploads started failing
        self._failed_attempts = 0
        self._thread = threading.Thread(target=self._run, name="r3store-writer", daemon=True)
        self._thread.start()

    def write(
        self, trajectory: TrajectoryWrite, block: bool = True, timeout: float | None = None
    ) -> None:
        """Queue one trajectory (or appended segment) for upload."""
        size = _nbytes(trajectory)
        limit = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._closing:
                raise R3StoreError("the writer is closed")
            while self._pending_bytes and self._pending_bytes + size > self.max_pending_bytes:
                if not block:
                    raise Backpressure("the writer's queue is full")
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    raise Backpressure("the writer's queue stayed full")
                self._cond.wait(left)
            self._queue.append((trajectory, size))
            self._pending_bytes += size
            self._cond.notify_all()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is acknowledged or refused; False on timeout."""
        limit = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.notify_all()
            while self._queue or self._inflight:
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def close(self, timeout: float | None = 60.0) -> WriterReport:
        """Send what is queued (up to `timeout` seconds), stop, and return the report."""
        self.flush(timeout)
        with self._cond:
            self._closing = True
            self._deadline = time.monotonic()
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            self.report.unsent.extend(w.trajectory_id for w, _ in self._queue)
            self._queue.clear()
        if self.report.unsent or self.report.failed:
            log.warning(
                "writer closed: %d unsent, %d refused",
                len(self.report.unsent),
                len(self.report.failed),
            )
        return self.report

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> list[tuple[TrajectoryWrite, int]] | None:
        with self._cond:
            while not self._queue:
                if self._closing:
                    return None
                self._cond.wait()
            if len(self._queue) < self.batch_size and not self._closing:
                self._cond.wait(self.linger)  # let a batch gather
            batch: list[tuple[TrajectoryWrite, int]] = []
            size = 0
            while self._queue and len(batch) < self.batch_size:
                if batch and size + self._queue[0][1] > self.batch_bytes:
                    break
                item = self._queue.popleft()
                batch.append(item)
                size += item[1]
            self._inflight += len(batch)
            return batch

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            leftover = self._send(batch)
            with self._cond:
                self._inflight -= len(batch)
                for item in reversed(leftover):  # unsent (closing): back to the queue front
                    self._queue.appendleft(item)
                self._pending_bytes -= sum(s for _, s in batch) - sum(s for _, s in leftover)
                self._cond.notify_all()
            if leftover:
                return

    def _send(self, batch: list[tuple[TrajectoryWrite, int]]) -> list[tuple[TrajectoryWrite, int]]:
        """Upload a batch; returns what could not be sent before closing."""
        attempt = 0
        while True:
            try:
                self.client.put(self.namespace, [w for w, _ in batch])
                self._recovered()
                with self._cond:
                    self.report.sent += len(batch)
                return []
            except InvalidInput as exc:
                self._answered(exc)
                if len(batch) == 1:
                    with self._cond:
                        self.report.failed[batch[0][0].trajectory_id] = str(exc)
                    return []
                leftovers = []
                for item in batch:  # find the bad ones; the others go through
                    leftovers += self._send([item])
                return leftovers
            except (StoreError, Backpressure) as exc:  # unreachable or busy: keep trying
                with self._cond:
                    if (
                        self._closing
                        and self._deadline is not None
                        and time.monotonic() >= self._deadline
                    ):
                        return batch
                self._failed(exc)
                with self._cond:  # a sleep that close() can cut short
                    self._cond.wait(min(10.0, self.retry_backoff * 2**attempt))
                attempt += 1
            except R3StoreError as exc:  # conflict, auth, stale: will not succeed by retrying
                self._answered(exc)
                with self._cond:
                    for w, _ in batch:
                        self.report.failed[w.trajectory_id] = f"{type(exc).__name__}: {exc}"
                return []

    def _failed(self, exc: R3StoreError) -> None:
        """One failed attempt: the first of a run is a WARNING, the others INFO."""
        self._failed_attempts += 1
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "uploads to %s failing (%s: %s); the writer keeps the trajectories queued "
                "and keeps retrying",
                self.client.base_url,
                type(exc).__name__,
                exc,
            )
        else:
            log.info("upload failed again (attempt %d; %s); retrying", self._failed_attempts, exc)

    def _answered(self, exc: R3StoreError) -> None:
        """A refusal: the server answered it (it has a status), unless the client
        refused the write itself before sending."""
        if getattr(exc, "status", None) is not None:
            self._recovered()

    def _recovered(self) -> None:
        """The server answered again after failed attempts: one WARNING saying so."""
        if self._failing_since is None:
            return
        log.warning(
            "uploads to %s recovered after %.1f s of failures (%d failed attempts)",
            self.client.base_url,
            time.monotonic() - self._failing_since,
            self._failed_attempts,
        )
        self._failing_since, self._failed_attempts = None, 0
