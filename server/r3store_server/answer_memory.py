"""What a read answer holds, charged to the memory budget while it is made and sent.

An answer of a read or a sample holds the rows it reads, as stored, until its last
piece is made, and pieces of the answer (`wire.encode_chunks`, `api_routes._answer`: a
piece holds less than `CHUNK_BYTES` of routes plus one row, a row never cut): the one
the connection sends, its copy in the connection's buffer, and the next one, made once
that one was handed over; an answer of one piece is held twice (made, and copied to the
connection). `answer_cost` is their sum, from the catalog before anything is read: the
stored streams, plus three pieces, at most twice the answer in the format asked.
Measured: four clients that read nothing of an answer of 83 MB of ids (pieces of
10 MB) grew the server's RSS by 35 MiB each, charged 42 MiB each; of an answer of
10 MB in one piece, 15 MiB each, charged 20 MiB each.

`AnswerCharge` holds that cost from the `MemoryBudget` that bounds uploads (one budget
for the memory of requests in flight), under the reader's API key, so the key's share
bounds its answers too: no room, and the read is answered 429 `backpressure` with
Retry-After before anything is read (a sample before anything is counted). One answer
is charged at most what one key may hold of the budget, so that every answer
`R3STORE_MAX_READ_BYTES` allows can be served once the budget is free. `ChargedAnswer`
gives the charge back when the answer has been sent, when its client went away, or when
its connection was dropped (`connections`: a client reading slower than
`R3STORE_SEND_MIN_RATE`).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from r3store.catalog_types import TrajectoryEntry
from r3store.errors import StoreError
from r3store.logic.streams import decoded_bytes
from r3store.protocol.wire import CHUNK_BYTES, ReadFormat, answer_bytes
from r3store.spec import RouteSpec
from r3store_server.limits import MemoryBudget


def answer_cost(
    spec: RouteSpec, fmt: ReadFormat, segments: Sequence[TrajectoryEntry], some_layers: bool
) -> int:
    """The bytes an answer of `segments` in `fmt` holds while it is sent: the stored
    streams, and three pieces (at most twice the answer). A read of `some_layers`
    decodes a segment whole to cut its layers: a piece holds that too."""
    stored = answer_bytes(spec, ReadFormat.ENCODED, segments)
    rows = [answer_bytes(spec, fmt, [s]) for s in segments]
    largest = max(
        (
            row + (decoded_bytes(spec, s.num_tokens) if some_layers else 0)
            for row, s in zip(rows, segments, strict=True)
        ),
        default=0,
    )
    return stored + min(2 * sum(rows), 3 * (CHUNK_BYTES + largest))


class AnswerCharge:
    """What one answer holds of `budget`, for `key`: `hold` as soon as its cost is
    known, `release` once, when it is sent or will never be."""

    def __init__(self, budget: MemoryBudget, key: str) -> None:
        self._budget = budget
        self.key = key
        self.most = min(budget.limit, budget.per_key)  # what one answer is charged at most
        self.nbytes = 0
        self._released = False
        self._lock = threading.Lock()

    def hold(self, nbytes: int) -> None:
        """Hold `nbytes` in all (at most `most`; asked again, the most asked):
        `Backpressure` when the budget, or the key's share of it, has no room."""
        nbytes = min(nbytes, self.most)
        with self._lock:
            if self._released:  # answered meanwhile (past the deadline): hold nothing
                raise StoreError("the read was answered before its memory was charged")
            if nbytes > self.nbytes:
                self._budget.take(nbytes - self.nbytes, self.key)
                self.nbytes = nbytes

    def release(self) -> None:
        with self._lock:
            self._released = True
            held, self.nbytes = self.nbytes, 0
        if held:
            self._budget.give(held, self.key)


class ChargedAnswer(Response):
    """`answer`, sent as it is; its `charge` released when the sending ends: the answer
    sent (the last piece handed to the connection, whose buffer drained), the client
    gone, or the connection dropped (either cancels the sending)."""

    def __init__(self, answer: Response, charge: AnswerCharge) -> None:
        self.answer = answer
        self.charge = charge
        self.status_code = answer.status_code
        self.raw_headers = answer.raw_headers
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.answer.background is None:
            self.answer.background = self.background

        async def sending(message: Message) -> None:
            if message["type"] == "http.response.body" and not message.get("more_body"):
                # the last bytes, then an empty end: the server takes a message only once
                # the connection's buffer is below its high-water mark, so the end is
                # taken once (all but that much of) the answer has left the process
                await send({**message, "more_body": True})
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        try:
            await self.answer(scope, receive, sending)
        finally:
            self.charge.release()
