"""What one client may make a real server process do: bodies read only after the key is
checked and bounded by route, headers bounded in size, count and time, slow bodies
timed out, connections bounded, one key's share of the upload memory, sample answers
no larger than asked, and answers charged to the memory budget while they are sent and
read at a minimum rate."""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from helpers import eventually, make_write
from http_helpers import KEYS, SPEC_JSON, ServerProcess, gauge
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import TrajectoryWrite
from r3store.testing.service import post_until_admitted
from r3store.testing.synthetic import decode_bomb

STATS = "/v1/namespaces/ns/stats/experts/trajectories"


def bearer(role: str) -> str:
    return f"Authorization: Bearer {KEYS[role]}\r\n"


@contextlib.contextmanager
def running(tmp_path: Path, **env: str) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path, None, env={f"R3STORE_{k.upper()}": v for k, v in env.items()})
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            made = http.post(
                "/v1/namespaces",
                json={"name": "ns", "spec": SPEC_JSON},
                headers={"Authorization": f"Bearer {KEYS['admin']}"},
            )
            assert made.status_code == 201, made.text
        yield server
    finally:
        server.stop()


def connect(server: ServerProcess, data: bytes = b"") -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    if data:
        sock.sendall(data)
    return sock


def until_closed(sock: socket.socket, within: float) -> tuple[bytes, bool]:
    """What the server sends within `within` seconds, and whether it closed the
    connection by then."""
    received = b""
    end = time.monotonic() + within
    try:
        while (left := end - time.monotonic()) > 0:
            sock.settimeout(left)
            chunk = sock.recv(65536)
            if not chunk:
                return received, True
            received += chunk
    except TimeoutError:
        return received, False
    except ConnectionResetError:
        return received, True
    finally:
        sock.close()
    return received, False


def head(method: str, path: str, *lines: str) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: r3store\r\n{''.join(lines)}\r\n".encode()


def open_files(server: ServerProcess) -> int:
    return len(os.listdir(f"/proc/{server.process.pid}/fd"))


# 1. bodies: the key first, then a limit by route


def test_a_body_without_a_key_is_refused_before_it_is_read(tmp_path: Path) -> None:
    with running(tmp_path) as server:
        gib = f"Content-Length: {1 << 30}\r\n"
        for path in (STATS, "/v1/namespaces/ns/trajectories", "/v1/nowhere"):
            sock = connect(server, head("POST", path, gib, "Content-Type: application/json\r\n"))
            sock.sendall(b'{"ids": ["')
            answer, closed = until_closed(sock, 5)
            assert answer.startswith(b"HTTP/1.1 401 "), (path, answer[:300])
            assert b'"code":"unauthorized"' in answer
            assert b"www-authenticate: bearer" in answer.lower()
            assert closed, path  # the rest of the body is not read either


def test_every_body_but_an_upload_is_bounded_by_its_route(tmp_path: Path) -> None:
    with running(tmp_path) as server:
        declared = head("POST", STATS, bearer("reader"), f"Content-Length: {5 << 20}\r\n")
        answer, closed = until_closed(connect(server, declared), 5)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
        assert closed

        sock = connect(
            server, head("POST", STATS, bearer("reader"), "Transfer-Encoding: chunked\r\n")
        )
        chunk = b"%x\r\n%s\r\n" % (1 << 20, b" " * (1 << 20))
        with contextlib.suppress(OSError):  # the server may close while this still sends
            for _ in range(6):
                sock.sendall(chunk)
        answer, closed = until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
        assert b"4194304" in answer

        with httpx.Client(base_url=server.url, timeout=30) as http:
            small = http.post(
                STATS, json={"ids": ["a"]}, headers={"Authorization": f"Bearer {KEYS['reader']}"}
            )
            assert small.status_code == 200, small.text

        # a client that goes on sending a body refused before it was read can send it all
        # and read the answer (the server drops what still comes before it closes): no
        # broken pipe, no reset
        declared = head("POST", STATS, bearer("reader"), f"Content-Length: {32 << 20}\r\n")
        sock = connect(server, declared)
        assert select.select([sock], [], [], 10)[0], "no answer before the body"
        sock.sendall(b" " * (32 << 20))
        answer, closed = until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
        assert closed


def test_a_path_open_without_a_key_takes_no_body_but_the_login_form(tmp_path: Path) -> None:
    with running(tmp_path, body_timeout="30") as server:
        big = f"Content-Length: {4 << 20}\r\n"
        for method, path in [
            ("POST", "/healthz"),
            ("GET", "/readyz"),
            ("POST", "/openapi.json"),
            ("PUT", "/docs/oauth2-redirect"),
            ("POST", "/ui/ns"),
            ("POST", "/ui/login"),  # its form is small
            ("POST", "/ui/logout"),
        ]:
            started = time.monotonic()
            answer, closed = until_closed(connect(server, head(method, path, big)), 5)
            assert answer.startswith(b"HTTP/1.1 413 "), (path, answer[:300])
            assert b'"code":"payload_too_large"' in answer, path
            assert closed, path  # refused before any of the body was read
            assert time.monotonic() - started < 2, path

        # streamed: refused at its first bytes, however few
        sock = connect(server, head("POST", "/healthz", "Transfer-Encoding: chunked\r\n"))
        sock.sendall(b"1\r\nx\r\n")
        answer, closed = until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]
        assert closed
        sock = connect(server, head("POST", "/ui/login", "Transfer-Encoding: chunked\r\n"))
        with contextlib.suppress(OSError):
            sock.sendall(b"%x\r\n%s\r\n" % (8192, b"k" * 8192))
        answer, closed = until_closed(sock, 5)
        assert answer.startswith(b"HTTP/1.1 413 "), answer[:300]

        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/healthz").status_code == 200
            assert http.post("/healthz", content=b"").status_code != 413
            origin = {"Origin": server.url}
            form = {"key": KEYS["reader"], "then": "/ui"}
            login = http.post("/ui/login", data=form, headers=origin)
            assert login.status_code == 303, login.text
            logout = http.post("/ui/logout", data={}, headers=origin)
            assert logout.status_code == 303, logout.text


# 2. headers, slow clients, connections


def test_headers_are_bounded_in_size_and_count(tmp_path: Path) -> None:
    with running(tmp_path) as server:
        started = time.monotonic()
        big = head("GET", "/healthz")[:-2] + b"X-Big: " + b"a" * (40 << 10)  # headers go on
        answer, closed = until_closed(connect(server, big), 5)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
        assert b'"code":"headers_too_large"' in answer
        assert closed
        assert time.monotonic() - started < 3

        many = head("GET", "/healthz", *(f"X-H{i}: v\r\n" for i in range(150)))
        answer, closed = until_closed(connect(server, many), 5)
        assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
        assert b"at most 100 headers" in answer
        assert closed
        assert httpx.get(f"{server.url}/healthz").status_code == 200


def test_headers_and_bodies_that_do_not_arrive_are_timed_out(tmp_path: Path) -> None:
    with running(tmp_path, header_timeout="1", body_timeout="1", body_min_rate="1000") as server:
        silent = connect(server)
        partial = connect(server, head("GET", "/healthz")[:-2])  # the blank line never comes
        json_body = connect(
            server,
            head(
                "POST",
                "/v1/namespaces/ns/routes/batch",
                bearer("reader"),
                "Content-Length: 100000\r\n",
            ),
        )
        json_body.sendall(b'{"ids": [')
        upload = connect(
            server,
            head(
                "POST",
                "/v1/namespaces/ns/trajectories",
                bearer("writer"),
                f"Content-Type: {CONTENT_TYPE}\r\n",
                "Content-Length: 100000\r\n",
            ),
        )
        started = time.monotonic()
        assert until_closed(silent, 5) == (b"", True)
        answer, closed = until_closed(partial, 5)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
        assert closed
        for sock in (json_body, upload):
            answer, closed = until_closed(sock, 5)
            assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
            assert b'"code":"request_timeout"' in answer
            assert closed
        assert time.monotonic() - started < 5


def test_connections_are_bounded(tmp_path: Path) -> None:
    with running(tmp_path, max_connections="32", header_timeout="60") as server:
        before = open_files(server)
        idle = [connect(server, head("GET", "/healthz")[:-2]) for _ in range(80)]
        started = time.monotonic()
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1
        eventually(lambda: open_files(server) <= before + 33, "the idle connections evicted")
        closed = sum(until_closed(sock, 0.2)[1] for sock in idle)
        assert closed >= 80 - 32

        # every connection busy with a request (its body still to come): 429 for a new one
        busy = [
            connect(server, head("POST", STATS, bearer("reader"), "Content-Length: 100\r\n"))
            for _ in range(32)
        ]
        answers: list[httpx.Response] = []
        eventually(  # once the server has read every busy request's headers
            lambda: (
                answers.append(httpx.get(f"{server.url}/healthz", timeout=5))
                or answers[-1].status_code == 429
            ),
            "a new connection refused while every one is busy",
        )
        assert answers[-1].json()["error"]["code"] == "backpressure"
        for sock in busy:
            sock.close()


def test_connections_answered_before_their_body_still_count(tmp_path: Path) -> None:
    with running(tmp_path, max_connections="16") as server:
        before = open_files(server)
        refused = []
        for _ in range(60):  # each answered 401 (or 429) at once, the body never sent
            sock = connect(server, head("POST", STATS, f"Content-Length: {1 << 20}\r\n"))
            sock.settimeout(5)
            assert sock.recv(65536).startswith(b"HTTP/1.1 4")
            refused.append(sock)
        held = open_files(server) - before
        assert held <= 16, held  # lingering, and counted
        started = time.monotonic()
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        assert time.monotonic() - started < 1
        for sock in refused:
            sock.close()


# 7. one writer cannot starve the others


# 1 MiB bodies at most, 6 MiB of upload memory in all
UPLOAD_MEMORY = {"max_body_bytes": str(1 << 20), "upload_memory_bytes": str(6 << 20)}
# a writer's upload of 1 MiB, up to its body
UPLOAD_HEAD = head(
    "POST",
    "/v1/namespaces/ns/trajectories",
    bearer("writer"),
    f"Content-Type: {CONTENT_TYPE}\r\n",
    f"Content-Length: {1 << 20}\r\n",
)


def upload_one(server: ServerProcess, role: str, write: TrajectoryWrite) -> httpx.Response:
    """The answer to `write` uploaded with `role`'s key, on a connection of its own."""
    with httpx.Client(base_url=server.url, timeout=30) as http:
        return http.post(
            "/v1/namespaces/ns/trajectories",
            content=encode_writes([write]),
            headers={"Authorization": f"Bearer {KEYS[role]}", "Content-Type": CONTENT_TYPE},
        )


def test_one_key_holds_at_most_its_share_of_the_upload_memory(tmp_path: Path) -> None:
    with running(tmp_path, **UPLOAD_MEMORY, request_timeout="4", body_timeout="30") as server:
        holds = [connect(server, UPLOAD_HEAD) for _ in range(2)]  # each would hold 3 MiB: all
        admin = {"Authorization": f"Bearer {KEYS['admin']}"}
        with httpx.Client(base_url=server.url, headers=admin) as http:
            held = lambda: gauge(http, "r3store_memory_held_bytes") >= 3 << 20  # noqa: E731
            eventually(held, "the writer's uploads hold its share")
        started = time.monotonic()
        other = upload_one(server, "admin", make_write("x"))
        assert other.status_code == 200, other.text
        assert time.monotonic() - started < 1.5
        answers = [until_closed(sock, 10)[0] for sock in holds]
        assert sorted(a[:12] for a in answers) == [b"HTTP/1.1 429", b"HTTP/1.1 503"], answers


def test_an_upload_that_does_not_arrive_gives_its_memory_back(tmp_path: Path) -> None:
    with running(tmp_path, **UPLOAD_MEMORY, body_timeout="1") as server:
        answer, closed = until_closed(connect(server, UPLOAD_HEAD + b"\xff" * 1000), 4)
        assert answer.startswith(b"HTTP/1.1 408 "), answer[:300]
        assert closed
        r = upload_one(server, "writer", make_write("y"))
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("strategy", ["fifo", "uniform"])
def test_a_sample_holds_whole_groups_and_at_most_n(tmp_path: Path, strategy: str) -> None:
    with running(tmp_path) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        writer = {"Authorization": f"Bearer {KEYS['writer']}", "Content-Type": CONTENT_TYPE}
        planted = [make_write(f"p{i}", tokens=2, group_id="planted") for i in range(300)]
        assert (
            http.post(
                "/v1/namespaces/ns/trajectories", content=encode_writes(planted), headers=writer
            ).status_code
            == 200
        )
        groups = [make_write(f"g{g}-{i}", group_id=f"g{g}") for g in range(3) for i in range(2)]
        assert (
            http.post(
                "/v1/namespaces/ns/trajectories", content=encode_writes(groups), headers=writer
            ).status_code
            == 200
        )
        reader = {"Authorization": f"Bearer {KEYS['reader']}"}
        from r3store.protocol.wire import decode_batch

        def sample(n: int) -> httpx.Response:
            body = {"n": n, "whole_groups": True, "strategy": strategy, "seed": 1}
            return http.post("/v1/namespaces/ns/routes/sample", json=body, headers=reader)

        taken = decode_batch(sample(5).content, decode=False)[1].ids
        assert len(taken) == 4, taken
        assert all(tid.startswith("g") for tid in taken), taken
        assert len({tid.split("-")[0] for tid in taken}) == 2
        refused = sample(1)
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_input"
        assert "the smallest 2" in refused.json()["error"]["message"]
        assert len(decode_batch(sample(300).content, decode=False)[1].ids) <= 300


# 4. what checking costs: charged before anything is decompressed

LARGE = {"num_layers": 48, "num_experts": 128, "top_k": 8}


def _bomb(name: str) -> bytes:
    """An upload of about 10 KB whose four encoded segments decode to 64 MiB each."""
    return encode_writes(decode_bomb(name))


def _established(port: int) -> int:
    """Connections to `port` the server holds open (its side, in /proc/net/tcp)."""
    lines = Path("/proc/net/tcp").read_text().splitlines()[1:]
    return sum(
        int(local.split(":")[1], 16) == port and state == "01"
        for local, _remote, state in (line.split()[1:4] for line in lines)
    )


def _peak_rss(server: ServerProcess) -> int:
    for line in Path(f"/proc/{server.process.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmHWM")


def test_checking_encoded_routes_is_charged_to_the_upload_memory(tmp_path: Path) -> None:
    budget = 640 << 20
    limits = {
        "max_body_bytes": str(8 << 20),
        "upload_memory_bytes": str(budget),
        "upload_memory_per_key": str(budget),
        "request_timeout": "120",
    }
    with running(tmp_path, **limits) as server, httpx.Client(base_url=server.url) as http:
        admin = {"Authorization": f"Bearer {KEYS['admin']}"}
        made = http.post("/v1/namespaces", json={"name": "large", "spec": LARGE}, headers=admin)
        assert made.status_code == 201, made.text
        bodies = [_bomb(f"u{i}") for i in range(12)]
        assert max(len(b) for b in bodies) < 64 << 10
        idle = _peak_rss(server)
        headers = {"Authorization": f"Bearer {KEYS['writer']}", "Content-Type": CONTENT_TYPE}

        def upload(body: bytes) -> list[int]:
            """Sent again on 429 (backpressure: no room now), as the clients do."""
            path = "/v1/namespaces/large/trajectories"
            return post_until_admitted(server.url, path, 120, 300, content=body, headers=headers)

        with ThreadPoolExecutor(len(bodies)) as pool:
            tries = list(pool.map(upload, bodies))
        grown = _peak_rss(server) - idle
    assert [t[-1] for t in tries] == [200] * len(bodies), tries  # each stored in the end
    assert all(set(t[:-1]) <= {429} for t in tries), tries
    assert sum(len(t) > 1 for t in tries) > 0, "all 12 at once fit: the test proves nothing"
    # 12 at once would hold about 12 x 150 MiB (936 MiB more measured before checking
    # was charged); charged, at most the budget is held
    assert grown < budget + (128 << 20), f"peak RSS grew {grown >> 20} MiB"


# 5. answers nobody reads

BIG_TOKENS = 24_000  # a trajectory of 48 layers, 8 of 128: 10.4 MB of ids and counts


def _big_answers(server: ServerProcess, count: int) -> bytes:
    """`count` trajectories stored in namespace "large"; the request (line, headers and
    body) of a read of all of them as decoded ids."""
    from r3store.spec import RouteSpec
    from r3store_client import Client

    topk = np.broadcast_to(np.arange(8, dtype=np.int32), (BIG_TOKENS - 1, 48, 8))
    with Client(server.url, KEYS["admin"]) as client:
        client.create_namespace("large", RouteSpec(**LARGE))
        client.put(
            "large", [TrajectoryWrite(f"big{i}", BIG_TOKENS, topk=topk) for i in range(count)]
        )
    return _read_request([f"big{i}" for i in range(count)])


def _read_request(ids: list[str]) -> bytes:
    """The request (line, headers and body) of a read of `ids` from namespace "large"
    as decoded ids."""
    body = json.dumps({"ids": ids, "format": "ids"}).encode()
    request = head(
        "POST",
        "/v1/namespaces/large/routes/batch",
        bearer("reader"),
        "Content-Type: application/json\r\n",
        f"Content-Length: {len(body)}\r\n",
    )
    return request + body


def _unread(server: ServerProcess, request: bytes) -> socket.socket:
    """A connection that sends `request` and reads none of the answer (its receive
    buffer small), once the answer began."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", server.port))
    sock.sendall(request)
    sock.settimeout(30)
    assert sock.recv(12, socket.MSG_PEEK) == b"HTTP/1.1 200"
    return sock


def test_an_answer_nobody_reads_holds_one_piece_then_its_connection_goes(tmp_path: Path) -> None:
    """Four clients each ask for 83 MB of decoded routes and read none of them: the
    server holds a piece of each (not the whole answer, twice: built, then queued to
    the socket), drops each connection once it has waited on its client longer than
    `R3STORE_SEND_TIMEOUT` (plus a second for each `R3STORE_SEND_MIN_RATE` bytes its
    socket took), and answers a bystander meanwhile."""
    with running(tmp_path, send_timeout="2") as server:
        request = _big_answers(server, 8)
        idle = _peak_rss(server)
        readers = [_unread(server, request) for _ in range(4)]
        assert httpx.get(f"{server.url}/healthz", timeout=5).status_code == 200
        dropped = lambda: not _established(server.port)  # noqa: E731
        eventually(dropped, "each reader's connection dropped", within=30)
        grown = _peak_rss(server) - idle
        full = 8 * BIG_TOKENS * 48 * 9  # the ids and counts of the answer
        for sock in readers:
            received, closed = until_closed(sock, 5)
            assert closed
            assert received.startswith(b"HTTP/1.1 200 ")
            assert len(received) < full // 2  # dropped, not sent whole
    # less than the answers themselves (957 MiB measured when each was built whole, then
    # queued to its socket whole; 216 MiB in pieces)
    assert grown < 4 * full, f"peak RSS grew {grown >> 20} MiB for four unread answers"


def test_connections_stalled_on_unread_answers_make_room_first(tmp_path: Path) -> None:
    """Connections whose clients read none of their answers hold every slot: a new
    connection closes the longest stalled one instead of being refused."""
    with running(tmp_path, max_connections="16", send_timeout="60") as server:
        request = _big_answers(server, 1)
        stalled = [_unread(server, request) for _ in range(16)]
        started = time.monotonic()
        answers = [httpx.get(f"{server.url}/healthz", timeout=5).status_code for _ in range(4)]
        assert answers == [200] * 4
        assert time.monotonic() - started < 5
        for sock in stalled:
            sock.close()


HELD = "r3store_memory_held_bytes"


def test_an_answer_holds_its_memory_from_the_budget_until_it_is_sent(tmp_path: Path) -> None:
    """While an answer is being sent it holds its stored rows and its pieces from the
    memory budget uploads share: a further read finds no room (429 with Retry-After,
    nothing held), and the charge goes back when the client goes away, when the
    server drops a client that reads nothing, and when an answer has been read."""
    limits = {  # a read of the two trajectories below holds more than half of it
        "max_body_bytes": str(8 << 20),
        "upload_memory_bytes": str(64 << 20),
        "upload_memory_per_key": str(64 << 20),
        "send_timeout": "4",
    }
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    with (
        running(tmp_path, **limits) as server,
        httpx.Client(base_url=server.url, headers=admin, timeout=30) as http,
    ):
        request = _big_answers(server, 2)  # two pieces of 10.4 MB of ids and counts
        idle = gauge(http, HELD)
        reader = {"Authorization": f"Bearer {KEYS['reader']}"}
        path = "/v1/namespaces/large/routes/batch"
        one = BIG_TOKENS * 48 * 9  # the ids and counts of one trajectory

        def read(ids: list[str]) -> httpx.Response:
            return http.post(path, json={"ids": ids, "format": "ids"}, headers=reader)

        unread = _unread(server, request)
        held = gauge(http, HELD) - idle
        # its two pieces twice (each made, and copied to the connection), and the rows
        # as stored (a few kB: these routes compress well)
        assert 4 * one <= held < 4 * one + (1 << 20), held
        refused = read(["big0", "big1"])
        assert refused.status_code == 429, refused.text
        assert refused.json()["error"]["code"] == "backpressure"
        assert int(refused.headers["retry-after"]) >= 1
        assert gauge(http, HELD) - idle == held  # the refused read holds nothing
        gone = time.monotonic()
        unread.close()  # the client goes away: its answer's charge goes back
        eventually(lambda: gauge(http, HELD) == idle, "the charge given back", within=3)
        assert time.monotonic() - gone < 3  # at the close, not when the server drops it

        unread = _unread(server, _read_request(["big0"]))  # one piece, answered whole
        assert 2 * one <= gauge(http, HELD) - idle < 2 * one + (1 << 20)
        eventually(lambda: gauge(http, HELD) == idle, "the dropped answer's charge back")
        received, closed = until_closed(unread, 5)  # dropped: read too slowly
        assert closed
        assert received.startswith(b"HTTP/1.1 200 ")
        assert len(received) < one  # not sent whole

        whole = read(["big0", "big1"])  # read at once: the charge back once it is sent
        assert whole.status_code == 200, whole.text
        assert len(whole.content) > 2 * one
        eventually(lambda: gauge(http, HELD) == idle, "the sent answer's charge back")


def _read_at(server: ServerProcess, request: bytes, rate: float | None) -> tuple[bytes, bool]:
    """The answer to `request` as a client reading `rate` bytes per second receives it
    (None: as fast as it can), and whether it came whole: the chunked stream's end."""
    sock = connect(server, request)
    sock.settimeout(60)
    received = bytearray()
    started = time.monotonic()
    with contextlib.suppress(ConnectionResetError):
        while not received.endswith(b"\r\n0\r\n\r\n"):
            chunk = sock.recv(64 << 10)
            if not chunk:
                break
            received += chunk
            if rate is not None:  # the pace: time that must pass
                time.sleep(max(0.0, started + len(received) / rate - time.monotonic()))
    sock.close()
    return bytes(received), received.endswith(b"\r\n0\r\n\r\n")


def test_a_client_that_reads_below_the_minimum_rate_is_dropped(tmp_path: Path) -> None:
    """R3STORE_SEND_MIN_RATE (32 MiB/s here, to be quick): a client that reads at 8 MiB/s
    is dropped once the answer has waited on it longer than R3STORE_SEND_TIMEOUT (2 s)
    plus a second for every 32 MiB it took, although it takes each 10 MB piece within
    the send timeout; one that reads at once gets the whole answer, and the dropped
    answer's charge goes back."""
    limits = {"send_timeout": "2", "send_min_rate": str(32 << 20)}
    admin = {"Authorization": f"Bearer {KEYS['admin']}"}
    with (
        running(tmp_path, **limits) as server,
        httpx.Client(base_url=server.url, headers=admin, timeout=30) as http,
    ):
        request = _big_answers(server, 8)
        full = 8 * BIG_TOKENS * 48 * 9
        idle = gauge(http, HELD)
        started = time.monotonic()
        received, whole = _read_at(server, request, 8 << 20)
        took = time.monotonic() - started
        assert received.startswith(b"HTTP/1.1 200 ")
        assert not whole, len(received)
        assert 2 <= took < 9, took  # after the grace, before 83 MB at 8 MiB/s (10 s)
        eventually(lambda: gauge(http, HELD) == idle, "the dropped answer's charge back")

        received, whole = _read_at(server, request, None)
        assert whole
        assert len(received) > full


def test_a_client_that_reads_above_the_minimum_rate_gets_its_answer(tmp_path: Path) -> None:
    """A client that reads at 4 MiB/s, above the minimum rate (1 MiB/s), takes more
    than R3STORE_SEND_TIMEOUT (1 s here) to read one 10 MB piece of its answer: it
    still gets the whole answer."""
    with running(tmp_path, send_timeout="1") as server:
        request = _big_answers(server, 2)
        received, whole = _read_at(server, request, 4 << 20)
        assert received.startswith(b"HTTP/1.1 200 ")
        assert whole, len(received)
        assert len(received) > 2 * BIG_TOKENS * 48 * 9


def test_a_read_of_some_layers_counts_what_it_decodes(tmp_path: Path) -> None:
    """A read of one layer decodes every segment whole to cut it: its answer is small on
    the wire, but what it decodes counts against R3STORE_MAX_READ_BYTES."""
    with running(tmp_path, max_read_bytes=str(12 << 20)) as server:
        _big_answers(server, 2)  # 2 x 9.2 MB of ids decoded, a few kB stored
        with httpx.Client(base_url=server.url, timeout=30) as http:
            reader = {"Authorization": f"Bearer {KEYS['reader']}"}
            path = "/v1/namespaces/large/routes/batch"
            whole = http.post(path, json={"ids": ["big0", "big1"]}, headers=reader)
            assert whole.status_code == 200, whole.text  # the stored streams: small
            one = {"ids": ["big0"], "layers": [0]}
            assert http.post(path, json=one, headers=reader).status_code == 200
            both = http.post(path, json={"ids": ["big0", "big1"], "layers": [0]}, headers=reader)
            assert both.status_code == 413, both.text
            assert "decoded to cut its layers" in both.json()["error"]["message"]


def test_a_lease_whose_request_was_answered_records_nothing(tmp_path: Path) -> None:
    """A lease that waits for the catalog past its request's deadline is answered 503;
    once the catalog frees up, its transaction sees the request answered and records
    nothing (said in the log): nobody holds it, and it keeps nothing from the next."""
    import sqlite3

    with (
        running(tmp_path, request_timeout="1") as server,
        httpx.Client(base_url=server.url, timeout=30) as http,
    ):
        writer = {"Authorization": f"Bearer {KEYS['writer']}", "Content-Type": CONTENT_TYPE}
        writes = encode_writes([make_write(f"t{i}") for i in range(4)])
        assert http.post(
            "/v1/namespaces/ns/trajectories", content=writes, headers=writer
        ).is_success
        reader = {"Authorization": f"Bearer {KEYS['reader']}"}
        catalog = sqlite3.connect(tmp_path / "catalog.db", isolation_level=None)
        catalog.execute("BEGIN IMMEDIATE")  # the catalog busy past the lease's deadline
        try:
            late = http.post("/v1/namespaces/ns/leases", json={"n": 4}, headers=reader)
            assert late.status_code == 503, late.text
        finally:
            catalog.execute("ROLLBACK")
            catalog.close()
        log = tmp_path / f"server-{server.port}.log"
        eventually(
            lambda: "was not recorded: its request was answered" in log.read_text(),
            "the late lease's transaction refusing itself",
        )
        assert http.get("/v1/namespaces/ns/leases", headers=reader).json()["leases"] == []
        taken = http.post("/v1/namespaces/ns/leases", json={"n": 4}, headers=reader)
        assert taken.status_code == 201, taken.text
        assert len(taken.json()["trajectory_ids"]) == 4
