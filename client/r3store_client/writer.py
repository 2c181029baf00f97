"""The rollout writer: queue trajectories, send them in the background in batches.

    with RolloutWriter(client, "run1") as writer:
        for out in engine_outputs:
            acked = writer.write(from_sglang(out.id, out.meta_info, out.total_tokens, 48, 8))
            refs.append(acked)  # a Future: its result is the route ref, once stored
    # leaving the block flushes; writer.report says what was sent and what was not

Memory is bounded by `max_pending_bytes`: `write` then blocks (or raises `Backpressure`
with `block=False`). A batch the server refuses as bad input is sent again trajectory by
trajectory, so one bad trajectory does not sink the others; those refused are reported
(and their futures raise the refusal). While the server is unreachable the writer keeps
its batch and retries with backoff; uploads are idempotent, so nothing is stored twice.
The first failure of a run of them is logged as a WARNING (each retry after it at INFO),
and so is the recovery, with how long uploads failed and how many attempts failed.
Whatever is still unsent when `close(timeout)` gives up is reported, never dropped
silently. How a batch is delivered (`Delivery`) is shared with `AsyncRolloutWriter`
(`r3store_client.aio`); only the waiting differs.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Generator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

from r3store.errors import Backpressure, InvalidInput, R3StoreError, StoreError
from r3store.records import PutResult, TrajectoryWrite
from r3store.refs import RouteRef
from r3store_client.call_base import CallBase
from r3store_client.client import Client
from r3store_client.steps import Stepper

log = logging.getLogger("r3store.client")


@dataclass
class WriterReport:
    sent: int = 0  # acknowledged by the server (stored, or stored already)
    failed: dict[str, str] = field(default_factory=dict)  # refused: id -> reason
    unsent: list[str] = field(default_factory=list)  # still queued when closed


def write_size(write: TrajectoryWrite) -> int:
    """What a queued write counts against `max_pending_bytes`."""
    routes = write.topk if write.topk is not None else write.mask
    return int(np.asarray(routes).nbytes) + 256


class Settled(Protocol):
    """A future either writer hands out (`concurrent.futures` or `asyncio`)."""

    def done(self) -> bool: ...
    def set_result(self, result: RouteRef, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


F = TypeVar("F", bound=Settled)


@dataclass
class Pending(Generic[F]):
    write: TrajectoryWrite
    size: int
    future: F

    def settle(self, result: RouteRef | BaseException) -> None:
        if self.future.done():  # given up on by its caller
            return
        if isinstance(result, BaseException):
            self.future.set_exception(result)
        else:
            self.future.set_result(result)


@dataclass(frozen=True)
class Attempt:
    """Upload these writes (answered with the put's results, or its error thrown in)."""

    writes: list[TrajectoryWrite]


@dataclass(frozen=True)
class Pause:
    """Wait before trying again (a wait that closing the writer cuts short)."""

    seconds: float


class Delivery:
    """What both writers share: the report, the logging of failures and recoveries, and
    how a batch is delivered (`deliver`)."""

    def __init__(self, base_url: str, retry_backoff: float) -> None:
        self.base_url = base_url
        self.retry_backoff = retry_backoff
        self.report = WriterReport()
        self._failing_since: float | None = None  # when uploads started failing
        self._failed_attempts = 0

    def deliver(
        self, batch: Sequence[Pending[Any]], give_up: Callable[[], bool]
    ) -> Generator[Attempt | Pause, Any, list[Pending[Any]]]:
        """Upload a batch; returns what could not be sent before `give_up()` (closing
        past its deadline)."""
        attempt = 0
        while True:
            try:
                results: list[PutResult] = yield Attempt([p.write for p in batch])
                self._recovered()
                self.report.sent += len(batch)
                for pending, result in zip(batch, results, strict=True):
                    pending.settle(result.ref)
                return []
            except InvalidInput as exc:
                self._answered(exc)
                if len(batch) == 1:
                    self._refuse(batch[0], exc)
                    return []
                leftovers = []
                for item in batch:  # find the bad ones; the others go through
                    leftovers += yield from self.deliver([item], give_up)
                return leftovers
            except (StoreError, Backpressure) as exc:  # unreachable or busy: keep trying
                if give_up():
                    return list(batch)
                self._failed(exc)
                yield Pause(min(10.0, self.retry_backoff * 2**attempt))
                attempt += 1
            except R3StoreError as exc:  # conflict, auth, stale: will not succeed by retrying
                self._answered(exc)
                for pending in batch:
                    self._refuse(pending, exc)
                return []

    def unsent(self, left: Sequence[Pending[Any]]) -> None:
        """Writes still queued when the writer closed: reported, their futures failed."""
        self.report.unsent.extend(p.write.trajectory_id for p in left)
        for pending in left:
            pending.settle(StoreError("not sent before the writer closed"))
        if self.report.unsent or self.report.failed:
            log.warning(
                "writer closed: %d unsent, %d refused",
                len(self.report.unsent),
                len(self.report.failed),
            )

    def _refuse(self, pending: Pending[Any], exc: R3StoreError) -> None:
        reason = str(exc) if isinstance(exc, InvalidInput) else f"{type(exc).__name__}: {exc}"
        self.report.failed[pending.write.trajectory_id] = reason
        pending.settle(exc)

    def _failed(self, exc: R3StoreError) -> None:
        """One failed attempt: the first of a run is a WARNING, the others INFO."""
        self._failed_attempts += 1
        if self._failing_since is None:
            self._failing_since = time.monotonic()
            log.warning(
                "uploads to %s failing (%s: %s); the writer keeps the trajectories queued "
                "and keeps retrying",
                self.base_url,
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
            self.base_url,
            time.monotonic() - self._failing_since,
            self._failed_attempts,
        )
        self._failing_since, self._failed_attempts = None, 0


C = TypeVar("C", bound=CallBase)


class Writer(Generic[C, F]):
    """What both rollout writers hold: their client (`C`) and namespace, the queue of
    pending writes with futures `F` (`Queued`), and how a batch is delivered
    (`Delivery`); each starts its own sender (`_start`)."""

    def __init__(
        self,
        client: C,
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
        self._delivery = Delivery(client.base_url, retry_backoff)
        self.report = self._delivery.report
        self._held: Queued[F] = Queued(batch_size, batch_bytes, max_pending_bytes, linger)
        self._start()

    def _start(self) -> None:
        raise NotImplementedError


class RolloutWriter(Writer[Client, Future[RouteRef]]):
    def _start(self) -> None:
        """The condition writes wait on, and the thread that sends them."""
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="r3store-writer", daemon=True)
        self._thread.start()

    def write(
        self, trajectory: TrajectoryWrite, block: bool = True, timeout: float | None = None
    ) -> Future[RouteRef]:
        """Queue one trajectory (or appended segment) for upload. The future's result
        is its route ref once the server acknowledged it; a refusal is its exception."""
        size = write_size(trajectory)
        limit = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            if self._held.closing:
                raise R3StoreError("the writer is closed")
            while not self._held.room(size):
                if not block:
                    raise Backpressure("the writer's queue is full")
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    raise Backpressure("the writer's queue stayed full")
                self._cond.wait(left)
            pending = Pending(trajectory, size, Future[RouteRef]())
            self._held.add(pending)
            self._cond.notify_all()
        return pending.future

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is acknowledged or refused; False on timeout."""
        limit = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            self._cond.notify_all()
            while not self._held.idle():
                left = None if limit is None else limit - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(0.05 if left is None else min(left, 0.05))
        return True

    def close(self, timeout: float | None = 60.0) -> WriterReport:
        """Send what is queued (up to `timeout` seconds), stop, and return the report."""
        self.flush(timeout)
        with self._cond:
            self._held.close()
            self._cond.notify_all()
        self._thread.join()
        with self._cond:
            left = self._held.drain()
        self._delivery.unsent(left)
        return self.report

    def __enter__(self) -> RolloutWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _take(self) -> list[Pending[Future[RouteRef]]] | None:
        with self._cond:
            while not self._held.items:
                if self._held.closing:
                    return None
                self._cond.wait()
            if self._held.gathering():
                self._cond.wait(self._held.linger)  # let a batch gather
            return self._held.take()

    def _run(self) -> None:
        while True:
            batch = self._take()
            if batch is None:
                return
            leftover = self._send(batch)
            with self._cond:
                self._held.returned(batch, leftover)
                self._cond.notify_all()
            if leftover:
                return

    def _give_up(self) -> bool:
        with self._cond:
            return self._held.give_up()

    def _send(self, batch: list[Pending[Any]]) -> list[Pending[Any]]:
        """Deliver a batch, blocking; returns what could not be sent before closing."""
        steps = Stepper(self._delivery.deliver(batch, self._give_up))
        for step in steps:
            if isinstance(step, Pause):
                with self._cond:  # a sleep that close() can cut short
                    self._cond.wait(step.seconds)
                continue
            try:
                steps.answer(self.client.put(self.namespace, step.writes))
            except R3StoreError as exc:
                steps.fail(exc)
        return steps.result


class Queued(Generic[F]):
    """What a writer holds: its queue of writes, their bytes, how many are being sent,
    and whether it is closing. Both writers keep one, under their own lock (a thread's
    condition, or an asyncio condition): nothing here locks or waits."""

    def __init__(
        self, batch_size: int, batch_bytes: int, max_pending_bytes: int, linger: float
    ) -> None:
        self.batch_size = batch_size
        self.batch_bytes = batch_bytes
        self.max_pending_bytes = max_pending_bytes
        self.linger = linger
        self.items: deque[Pending[F]] = deque()
        self.bytes = 0
        self.inflight = 0
        self.closing = False
        self.deadline: float | None = None

    def room(self, size: int) -> bool:
        """Whether a write of `size` bytes fits (one always does into an empty queue)."""
        return not self.bytes or self.bytes + size <= self.max_pending_bytes

    def add(self, pending: Pending[F]) -> None:
        self.items.append(pending)
        self.bytes += pending.size

    def gathering(self) -> bool:
        """Whether to linger for more writes before sending a batch."""
        return len(self.items) < self.batch_size and not self.closing

    def take(self) -> list[Pending[F]]:
        """Up to `batch_size` queued writes from the front, of at most `batch_bytes`
        (one at least), counted as being sent."""
        batch: list[Pending[F]] = []
        total = 0
        while self.items and len(batch) < self.batch_size:
            if batch and total + self.items[0].size > self.batch_bytes:
                break
            item = self.items.popleft()
            batch.append(item)
            total += item.size
        self.inflight += len(batch)
        return batch

    def returned(self, batch: Sequence[Pending[F]], leftover: Sequence[Pending[F]]) -> None:
        """A batch delivered: what could not be sent (closing) goes back to the front."""
        self.inflight -= len(batch)
        for item in reversed(leftover):
            self.items.appendleft(item)
        self.bytes -= sum(p.size for p in batch) - sum(p.size for p in leftover)

    def idle(self) -> bool:
        return not self.items and not self.inflight

    def close(self) -> None:
        """Stop taking writes; what is still unsent from now on is given up."""
        self.closing = True
        self.deadline = time.monotonic()

    def give_up(self) -> bool:
        return self.closing and self.deadline is not None and time.monotonic() >= self.deadline

    def drain(self) -> list[Pending[F]]:
        left = list(self.items)
        self.items.clear()
        return left
