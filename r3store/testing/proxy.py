"""A TCP proxy that loses answers on request, for tests of a misbehaving network.

    with FaultyProxy("127.0.0.1", 8333) as proxy:      # listens on proxy.port
        proxy.lose_answers(1)   # the next request reaches the server; its answer never
                                # comes back and the connection is closed

The request is delivered whole, so the server acts on it: exactly the case of a client
that times out (or loses its connection) after the server did the work, and retries.
Interim answers (`100 Continue`, which S3 clients wait for before sending a body) pass.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from types import TracebackType


class FaultyProxy:
    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._to_lose = 0
        self.lost = 0  # answers lost so far
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, name="faulty-proxy", daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def lose_answers(self, count: int) -> None:
        """Lose the answers of the next `count` connections that get one."""
        with self._lock:
            self._to_lose = count

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._upstream)
            except OSError:
                client.close()
                continue
            with self._lock:
                self._sockets += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, True), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket, answers: bool) -> None:
        try:
            while data := source.recv(1 << 16):
                interim = data.startswith(b"HTTP/1.1 1")  # 100 Continue: the body follows
                if answers and not interim and self._take_loss():
                    break
                sink.sendall(data)
        except OSError:
            pass
        for sock in (source, sink):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _take_loss(self) -> bool:
        with self._lock:
            if self._to_lose <= 0:
                return False
            self._to_lose -= 1
            self.lost += 1
            return True

    def close(self) -> None:
        self._listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.close()

    def __enter__(self) -> FaultyProxy:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
