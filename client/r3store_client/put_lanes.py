"""Encoded puts of one client that go together (`Client(put_lanes=...)`).

At most `lanes` encoded puts of a namespace are under way at once. A put that finds
every lane taken waits; the first waiting put to find a lane free carries the others
that wait with it, encoded with the same dictionary, in one put: one blob and one
commit for direct writes, one upload through the server otherwise (`Lanes.join`). Each
put still returns after the commit that made its writes durable, with its own results.
A put whose carrier failed goes again alone (in a lane, carrying nobody), so that its
answer, or its refusal, is its own.

Nothing here blocks: a put waits by yielding `Wait` on futures, which `Client` waits on
in its thread and `AsyncClient` awaits. Waking is broadcast (every waiting put looks
again when a lane frees), so a waiting put that is cancelled loses no other put's turn.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Generator, Sequence
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field
from typing import Any

from r3store.protocol.models import PutItem
from r3store.records import TrajectoryWrite
from r3store_client.steps import Wait

CARRY_WRITES = 32  # writes one put carries at most, its own included
CARRY_BYTES = 16 << 20  # encoded bytes one put carries at most (half a plan's at most)


def encoded_size(writes: Sequence[TrajectoryWrite]) -> int:
    """The bytes encoded writes put in a blob."""
    total = 0
    for w in writes:
        sent = w.encoded
        if sent is not None:
            total += sum(len(b) for b in (sent.ids, sent.counts, sent.order, sent.tokens) if b)
    return total


def _settled_once() -> Future[Any]:
    """A future only a result settles: cancelling what waits on it (asyncio's
    `wrap_future` cancels its source) leaves it pending."""
    future: Future[Any] = Future()
    future.set_running_or_notify_cancel()
    return future


@dataclass(eq=False)
class Waiting:
    """A put that waits for a lane: its writes as given and as encoded, the digest of the
    dictionary they were encoded with, and what its carrier answers: its results, or
    None when the carrier failed. A `solo` put carries nobody and is carried by nobody
    (one whose carrier failed, sent again)."""

    writes: list[TrajectoryWrite]
    encoded: list[TrajectoryWrite]
    digest: bytes | None
    size: int
    solo: bool = False
    answer: Future[list[PutItem] | None] = field(default_factory=_settled_once)
    taken: bool = False  # by a put that carries it

    def again_alone(self) -> Waiting:
        """The same writes as a solo put, its carrier having failed."""
        return Waiting(self.writes, self.encoded, self.digest, self.size, solo=True)


@dataclass(frozen=True)
class Lead:
    """A lane is this put's: send `group`'s writes (its own first) in one put, then
    `Lanes.carried` and `Lanes.release`."""

    group: list[Waiting]


@dataclass(frozen=True)
class Carried:
    """Another put sent these writes: their results."""

    items: list[PutItem]


@dataclass(frozen=True)
class Alone:
    """The carrier failed: join again as a solo put (`Waiting.again_alone`)."""


Turn = Lead | Carried | Alone


@dataclass(eq=False)
class _Namespace:
    busy: int = 0
    waiting: list[Waiting] = field(default_factory=list)
    freed: Future[None] = field(default_factory=_settled_once)  # set when a lane frees


class Lanes:
    """The lanes of one client's encoded puts, per namespace. A process forked with
    puts under way starts with free lanes, and so does a pickled copy."""

    def __init__(self, lanes: int) -> None:
        if lanes < 1:
            raise ValueError("put_lanes must be at least 1 (or None: each put goes alone)")
        self.lanes = lanes
        self._reset()

    def __reduce__(self) -> tuple[type[Lanes], tuple[int]]:
        return Lanes, (self.lanes,)

    def _reset(self) -> None:
        self._pid = os.getpid()
        self._lock = threading.Lock()
        self._namespaces: dict[str, _Namespace] = {}

    def join(self, namespace: str, entry: Waiting, carry_bytes: int) -> Generator[Wait, Any, Turn]:
        """Wait for a lane, or for another put to carry `entry`; a put that gets a lane
        after waiting carries others up to `carry_bytes` of encoded routes."""
        if self._pid != os.getpid():
            self._reset()
        with self._lock:
            state = self._namespaces.setdefault(namespace, _Namespace())
            if state.busy < self.lanes and not state.waiting:
                state.busy += 1
                return Lead([entry])
            state.waiting.append(entry)
        try:
            while True:
                with self._lock:
                    if entry.answer.done():
                        break
                    if entry.taken:  # carried: only its answer is awaited
                        waits: tuple[Future[Any], ...] = (entry.answer,)
                    elif state.busy < self.lanes:
                        state.busy += 1
                        return Lead(self._group(state, entry, carry_bytes))
                    else:
                        waits = (entry.answer, state.freed)
                yield Wait(waits)
        finally:
            with self._lock:
                if entry in state.waiting:  # given up while waiting: carried by nobody
                    state.waiting.remove(entry)
                self._forget(namespace, state)
        items = entry.answer.result()
        return Alone() if items is None else Carried(items)

    @staticmethod
    def _group(state: _Namespace, entry: Waiting, carry_bytes: int) -> list[Waiting]:
        """`entry` and the puts waiting longest that fit with it (the same dictionary,
        at most `CARRY_WRITES` writes and `carry_bytes`, none solo), taken off the
        queue."""
        state.waiting.remove(entry)
        group, count, size = [entry], len(entry.writes), entry.size
        for other in [] if entry.solo else list(state.waiting):
            if count + len(other.writes) > CARRY_WRITES:
                break
            if other.solo or other.digest != entry.digest or size + other.size > carry_bytes:
                continue
            state.waiting.remove(other)
            other.taken = True
            group.append(other)
            count, size = count + len(other.writes), size + other.size
        return group

    @staticmethod
    def carried(group: Sequence[Waiting], items: Sequence[PutItem] | None) -> list[PutItem] | None:
        """Hand each carried put not yet answered its results (`items`, in the group's
        order), or None (`items` None, or not one result a write: the carrier failed,
        and they go again alone); returns the leader's own, None when it failed."""
        if items is not None and len(items) != sum(len(e.writes) for e in group):
            items = None
        at = len(group[0].writes)
        for other in group[1:]:
            end = at + len(other.writes)
            with contextlib.suppress(InvalidStateError):  # answered already
                other.answer.set_result(None if items is None else list(items[at:end]))
            at = end
        return None if items is None else list(items[: len(group[0].writes)])

    def release(self, namespace: str) -> None:
        """A lane is free again: every waiting put looks."""
        with self._lock:
            state = self._namespaces.get(namespace)
            if state is None:  # forked since the lane was taken
                return
            state.busy -= 1
            freed, state.freed = state.freed, _settled_once()
            self._forget(namespace, state)
        freed.set_result(None)

    def _forget(self, namespace: str, state: _Namespace) -> None:
        """Nothing kept of a namespace whose lanes are free and that nobody waits on."""
        if not state.busy and not state.waiting and self._namespaces.get(namespace) is state:
            del self._namespaces[namespace]
