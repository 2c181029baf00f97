"""Limits on connections and request headers: uvicorn's httptools protocol with the
bounds it lacks.

uvicorn bounds neither the size nor the arrival time of a request's headers when it
parses with httptools (its `h11_max_incomplete_event_size` is for h11 only, and
httptools joins a long header line piece by piece as it arrives: quadratic time), nor
the connections it holds (`limit_concurrency` answers 503 only once a request's headers
are in, counting the connections that send nothing among those that are busy).
`GuardedHttpTools` adds:

- a request whose line and headers pass `max_header_bytes`, or whose headers number
  more than `max_headers`, is answered 431 `headers_too_large` and its connection closed;
- a request line and headers that take longer than `header_timeout` seconds to arrive
  close the connection (408 `request_timeout` when part of them came); between
  requests an idle connection closes after uvicorn's keep-alive timeout;
- at most `max_connections` connections are open: one more closes the connection that
  has waited longest for a request (idle, or still sending its headers), or, when every
  connection is busy with a request, is itself answered 429 `backpressure` and closed;
- an answer the client reads too slowly: the time the answer waits on its client (its
  send buffer full, past asyncio's high-water mark, until drained to the low-water
  mark) may be at most `send_timeout` seconds plus one second for every
  `send_min_rate` bytes of the answer the client took so far; past that the
  connection is dropped with what it still had to send, so an answer read slowly, or
  not at all, holds its memory that long at most. A connection whose send buffer is
  full is closed when a new one needs room and none is idle;
- a connection closed after an answer sent before its request's body was read (a 401,
  413 or 429 from `limits.BodyGuard`) lingers: the answer and the end of the stream go
  out, and what the client still sends is read and dropped, for up to `LINGER_SECONDS`
  and `LINGER_BYTES`, so that the client reads the answer instead of a reset. A
  lingering connection (or one closed while its answer is still being sent) still
  counts among the `max_connections`, and is the first to close when a new one needs
  room; at most `max_lingering` linger at once (one more ends the longest lingering),
  and one whose answer is not read within `LINGER_SECONDS` is aborted.

`protocol(settings, connections)` makes the class for `uvicorn.Config(http=...)`;
`fit_open_files(connections)` raises the process's open-file limit to hold them.
"""

from __future__ import annotations

import json
import logging
import resource
from asyncio import TimerHandle, Transport
from collections import OrderedDict
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from r3store.errors import Backpressure, HeadersTooLarge, RequestTimeout
from r3store_server.settings import Settings

log = logging.getLogger("r3store.server")
SPARE_FILES = 256  # open files kept for the store, the catalog, logs and threads
LINGER_SECONDS = 2.0
LINGER_BYTES = 64 << 20


class _Lingering:
    """The connection's transport as uvicorn's request cycle sees it: `close` lingers
    while the request's body is still coming (`GuardedHttpTools._linger`)."""

    def __init__(self, transport: Transport, protocol: GuardedHttpTools) -> None:
        self._transport = transport
        self._protocol = protocol

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self._protocol._written += len(data)
        self._transport.write(data)

    def close(self) -> None:
        if self._protocol._body_pending and not self._protocol._lingering:
            self._protocol._linger()
        elif not self._protocol._lingering:
            self._transport.close()
            self._protocol._closing()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class _Refused(Exception):
    """Raised in a parser callback to stop parsing a request that is refused."""


class GuardedHttpTools(HttpToolsProtocol):
    max_header_bytes = 32 << 10
    max_headers = 100
    header_timeout = 10.0
    max_connections = 1024
    max_lingering = 256
    send_timeout = 10.0
    send_min_rate = 1 << 20
    # the server's connections waiting for a request, longest waiting first (one order
    # per class `protocol` makes): the next to close when a new one needs room
    waiting_order: ClassVar[OrderedDict[GuardedHttpTools, None]] = OrderedDict()
    # the server's connections closing (lingering, or sending their last answer) but
    # still open, longest first: out of uvicorn's `connections`, counted all the same
    closing_order: ClassVar[OrderedDict[GuardedHttpTools, None]] = OrderedDict()
    # the server's connections whose send buffer is full (the client reads nothing now),
    # longest first: the first closed when room is needed
    stalled_order: ClassVar[OrderedDict[GuardedHttpTools, None]] = OrderedDict()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._waiting = True  # for a request's line and headers (idle, or some came)
        self._began = False  # a request's first bytes came
        self._header_bytes = 0
        self._header_count = 0
        self._header_timer: TimerHandle | None = None
        self._refusal: str | None = None  # why parsing stopped, to answer
        self._body_pending = False  # a request's headers came, not all its body yet
        self._requests = 0  # whose headers came
        self._lingering = False
        self._lingered = 0
        self._raw: Transport | None = None
        self._linger_timer: TimerHandle | None = None
        self._send_timer: TimerHandle | None = None
        self._written = 0  # bytes handed to the transport, all answers
        self._answer_from = 0  # of them, sent before this answer
        self._waited = 0.0  # seconds this answer waited on its client, before this wait
        self._paused_at = 0.0  # when this wait began

    # connections

    def connection_made(self, transport: Transport) -> None:  # type: ignore[override]
        self._raw = transport
        super().connection_made(_Lingering(transport, self))  # type: ignore[arg-type]
        self._arm()
        if len(self.connections) + len(self.closing_order) > self.max_connections:
            self._make_room()
        if not self.transport.is_closing():
            self.waiting_order[self] = None

    def connection_lost(self, exc: Exception | None) -> None:
        self._body_pending = False  # nothing more comes: closing is closing
        self.waiting_order.pop(self, None)
        self.closing_order.pop(self, None)
        self._disarm()
        self._unstalled()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        super().connection_lost(exc)

    # answers read too slowly

    def _sent(self) -> int:
        """Bytes of this answer the client has taken (the kernel's buffers count)."""
        buffered = self._raw.get_write_buffer_size() if self._raw is not None else 0
        return self._written - buffered - self._answer_from

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._send_timer is None:
            self._paused_at = self.loop.time()
            self.stalled_order[self] = None
            self._check_send()

    def resume_writing(self) -> None:
        if self._send_timer is not None:
            self._waited += self.loop.time() - self._paused_at
        self._unstalled()
        super().resume_writing()

    def _unstalled(self) -> None:
        self.stalled_order.pop(self, None)
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _check_send(self) -> None:
        """While the answer waits on its client: drop the connection once it has waited
        longer than its sending may take, else look again when it would have."""
        self._send_timer = None
        waited = self._waited + self.loop.time() - self._paused_at
        sent = self._sent()
        allowed = self.send_timeout + sent / self.send_min_rate
        if waited < allowed:
            self._send_timer = self.loop.call_later(max(0.1, allowed - waited), self._check_send)
            return
        log.info(
            "dropped a connection whose client read its answer too slowly: %d bytes in "
            "%.1f s waiting on it (R3STORE_SEND_TIMEOUT %g s, R3STORE_SEND_MIN_RATE %d bytes/s)",
            sent,
            waited,
            self.send_timeout,
            self.send_min_rate,
        )
        self._abort()

    def _next_answer(self) -> None:
        """The next answer's time starts now (the bytes still buffered count as its)."""
        self._answer_from += self._sent()
        self._waited = 0.0
        self._paused_at = self.loop.time()

    def _linger(self) -> None:
        """Send the end of the stream after the answer, and drop what still comes for a
        while before closing."""
        raw = self._raw
        assert raw is not None
        self._lingering = True
        self.connections.discard(self)
        self.waiting_order.pop(self, None)
        self._disarm()
        if not raw.can_write_eof():
            raw.close()
            self._closing()
            return
        raw.write_eof()
        raw.resume_reading()
        lingering = [c for c in self.closing_order if c._lingering]
        for oldest in lingering[: max(0, len(lingering) + 1 - self.max_lingering)]:
            oldest._abort()
        self.closing_order[self] = None
        self._linger_timer = self.loop.call_later(LINGER_SECONDS, self._end_linger)

    def _end_linger(self) -> None:
        """Close after lingering: at once if the answer is still not read."""
        raw = self._raw
        assert raw is not None
        if raw.get_write_buffer_size():
            self._abort()
        else:
            raw.close()

    def _closing(self) -> None:
        """Count a connection closed while its last bytes are still to be sent until it
        is gone, aborting it if they are not sent within `LINGER_SECONDS`."""
        raw = self._raw
        if raw is None or not raw.get_write_buffer_size() or self in self.closing_order:
            return  # closes at once
        self.connections.discard(self)
        self.waiting_order.pop(self, None)
        self.closing_order[self] = None
        if self._linger_timer is None:
            self._linger_timer = self.loop.call_later(LINGER_SECONDS, self._abort)

    def _abort(self) -> None:
        """Close now, dropping what is still to be sent: counted out at once."""
        self._unstalled()
        self.closing_order.pop(self, None)
        self.connections.discard(self)
        self.waiting_order.pop(self, None)
        self._disarm()
        if self._linger_timer is not None:
            self._linger_timer.cancel()
            self._linger_timer = None
        if self._raw is not None:
            self._raw.abort()

    def eof_received(self) -> None:
        if self._lingering and self._raw is not None:
            self._raw.close()

    def _idle(self) -> bool:
        """Waiting for a request (none in progress): a connection that may be closed."""
        busy = self.cycle is not None and not self.cycle.response_complete
        return self._waiting and not busy and not self.pipeline and not self.transport.is_closing()

    def _make_room(self) -> None:
        """Close the connection closing longest (lingering, or sending a last answer),
        else the one that has waited longest for a request, else the one whose answer
        has waited longest on a client that reads none of it, or refuse this one when
        every other is busy with a request its client keeps up with."""
        if self.closing_order:  # the first to go: lingering, or sending a last answer
            next(iter(self.closing_order))._abort()
            return
        order = self.waiting_order
        while order:
            oldest, _ = order.popitem(last=False)
            if oldest is not self and oldest._idle():
                oldest._abort()  # nothing to send: an answer not read yet is dropped
                return
        if self.stalled_order:  # its client reads nothing of its answer now
            next(iter(self.stalled_order))._abort()
            return
        message = f"the server holds its most connections ({self.max_connections}), all busy"
        self._answer(429, Backpressure.code, f"{message}: retry later", retry_after=True)

    def _close(self) -> None:
        self.connections.discard(self)  # counted out now: its close completes later
        self.waiting_order.pop(self, None)
        self._disarm()
        self.transport.close()

    def _answer(self, status: int, code: str, message: str, retry_after: bool = False) -> None:
        """Answer `status` with an error body and close (only while no response is being
        sent on this connection; else just close)."""
        if self.cycle is None or self.cycle.response_complete:
            error = {"error": {"code": code, "message": message}}
            body = json.dumps(error, separators=(",", ":")).encode()
            head = [
                STATUS_LINE[status],
                b"content-type: application/json\r\n",
                b"content-length: %d\r\n" % len(body),
                b"connection: close\r\n",
                b"retry-after: 1\r\n" if retry_after else b"",
                b"\r\n",
            ]
            self.transport.write(b"".join(head) + body)
        self._close()

    # the time headers take

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._timed_out)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _timed_out(self) -> None:
        self._header_timer = None
        if not self._waiting or self.transport.is_closing():
            return
        if not self._idle():  # the request before is still being answered
            self._arm()
            return
        if not self._began:  # nothing of a request came
            self._close()
            return
        why = f"the request line and headers did not arrive within {self.header_timeout:g} s"
        self._answer(408, RequestTimeout.code, why)

    # the size of headers

    def data_received(self, data: bytes) -> None:
        if self._lingering:
            self._lingered += len(data)
            if self._lingered > LINGER_BYTES and self._raw is not None:
                self._raw.close()
            return
        if self.transport.is_closing():
            return
        waiting, requests = self._waiting, self._requests
        if waiting:
            self._arm()  # the first bytes of a request after an idle time
        super().data_received(data)
        # bytes that all went to headers still incomplete (none to a request's body)
        headers = waiting and self._waiting and requests == self._requests
        if headers and not self.transport.is_closing():
            self._header_bytes += len(data)
            if self._header_bytes > self.max_header_bytes:
                self._too_large(
                    f"the request line and headers exceed {self.max_header_bytes} bytes"
                )

    def _too_large(self, why: str) -> None:
        self._answer(431, HeadersTooLarge.code, why)

    def send_400_response(self, msg: str) -> None:
        if self._refusal is not None:  # parsing stopped by `on_header`
            self._too_large(self._refusal)
            return
        super().send_400_response(msg)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        self._header_count = 0

    def on_header(self, name: bytes, value: bytes) -> None:
        self._header_count += 1
        if self._header_count > self.max_headers:
            self._refusal = f"a request may have at most {self.max_headers} headers"
            raise _Refused
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self.waiting_order.pop(self, None)
        self._waiting = False
        self._body_pending = True
        self._requests += 1
        self._header_bytes = 0
        self._disarm()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._body_pending = False
        self._waiting = True
        self._began = False

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._next_answer()
        if self._idle():  # kept alive, waiting for the next request
            self.waiting_order[self] = None


def protocol(settings: Settings, connections: int) -> type[GuardedHttpTools]:
    """`GuardedHttpTools` with the limits of `settings`, holding `connections` at most."""
    limits = {
        "max_header_bytes": settings.max_header_bytes,
        "max_headers": settings.max_headers,
        "header_timeout": settings.header_timeout,
        "send_timeout": settings.send_timeout,
        "send_min_rate": settings.send_min_rate,
        "max_connections": connections,
        "max_lingering": max(1, connections // 4),
    }
    orders: dict[str, OrderedDict[GuardedHttpTools, None]] = {
        "waiting_order": OrderedDict(),
        "closing_order": OrderedDict(),
        "stalled_order": OrderedDict(),
    }
    return type("GuardedHttpTools", (GuardedHttpTools,), {**limits, **orders})


def fit_open_files(connections: int) -> int:
    """Raise the soft limit on open files (up to the hard one) to hold `connections`
    and the files the server needs besides; the connections that fit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + SPARE_FILES
    if soft != resource.RLIM_INFINITY and soft < wanted:
        raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft != resource.RLIM_INFINITY and soft < wanted:
        fits = max(16, soft - SPARE_FILES)
        log.warning(
            "open files are limited to %d: holding %d connections, not R3STORE_MAX_CONNECTIONS "
            "(%d); raise the limit (ulimit -n) to hold them all",
            soft,
            fits,
            connections,
        )
        return fits
    return connections
