"""Resource abuse against a real server process: what one hostile client can cost.

Each case starts a fresh `r3store-server` (the embedded store, the default limits, a key
per role) and runs one attack, bounded in count and time, against 127.0.0.1 only, while
a bystander asks `/healthz` every 0.1 s on a new connection. Per case: the server's
peak RSS (`VmHWM` of a process that ran only this case, beside its idle RSS), the
bystander's worst `/healthz` latency (an answer that failed counts as the time it took,
at most 5 s) and the CPU seconds the server spent during the attack (`/proc/PID/stat`).
Goals: peak RSS under 1 GiB, the bystander's `/healthz` under 1 s.

The cases (docs/api.md, "Errors", says what bounds each):

- unauthenticated bodies: three 1 GiB bodies without a key to the per-trajectory load;
- big headers: three 48 MiB header lines;
- slow headers: 3,000 connections sending a header line every 2 s, for 15 s;
- slow bodies: 500 JSON bodies sent a byte a second, for 15 s;
- idle connections: 1,100 connections that send nothing, for 12 s;
- budget hold: a writer declares two uploads of the largest body and sends nothing,
  while another writer uploads every 0.5 s (its answers are counted);
- version bomb: one upload of 2,000 one-token rows of distinct future policy versions,
  then five `/metrics` scrapes;
- many rows: one upload of 100,000 one-token rows of a 48-layer, 128-expert namespace;
- amplified reads: four very compressible segments of 64 MiB as masks, read as `mask`;
- decode bombs: 32 uploads at once of four encoded segments of about 10 kB that decode
  to 64 MiB each, sent again on 429;
- unread answers: eight clients ask for 216 MiB of decoded ids each and read nothing;
- layer reads: 32 readers at once ask for one layer of 12 trajectories that decode to
  9 MiB each (under the read limit), sent again on 429;
- wide schema: an upload with 20,000 extra columns;
- planted group: a prompt group of 30,000 trajectories, sampled with `n=1` whole groups.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa

from bench.figures import Figure
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import TrajectoryWrite
from r3store.testing.service import post_until_admitted, start_server, stop_server
from r3store.testing.synthetic import decode_bomb, uniform_topk
from r3store_client import Client

MiB = 1 << 20
KEYS = {
    "admin": "abuse-admin-key-0123456789abcdef",
    "writer": "abuse-writer-key-0123456789abcde",
    "writer2": "abuse-writer2-key-0123456789abcd",
    "reader": "abuse-reader-key-0123456789abcde",
}
ROLES = {"admin": "admin", "writer": "writer", "writer2": "writer", "reader": "reader"}
SPECS = {
    "ns": {"num_layers": 4, "num_experts": 64, "top_k": 4},
    "large": {"num_layers": 48, "num_experts": 128, "top_k": 8},  # Qwen3-30B-A3B's shape
}
STATS = "/v1/namespaces/ns/stats/experts/trajectories"
PROBE_TIMEOUT = 5.0


def _auth(role: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[role]}"}


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def _cpu_seconds(pid: int) -> float:
    """User and system CPU time of the process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _rss(pid: int) -> int:
    try:
        import psutil

        return int(psutil.Process(pid).memory_info().rss)
    except ImportError:
        return _status(pid, "VmRSS")


class Bystander:
    """`/healthz` every 0.1 s on a new connection, each answer's time kept."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.times: list[float] = []
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            try:
                ok = httpx.get(f"{self.url}/healthz", timeout=PROBE_TIMEOUT).status_code == 200
            except httpx.HTTPError:
                ok = False
            self.times.append(min(time.perf_counter() - started, PROBE_TIMEOUT))
            self.failures += not ok
            self._stop.wait(0.1)

    def __enter__(self) -> Bystander:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(PROBE_TIMEOUT + 1)


@dataclass
class Server:
    url: str
    pid: int
    outcome: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def serving(env: dict[str, str] | None = None) -> Iterator[Server]:
    keys = [{"name": n, "role": ROLES[n], "key": k} for n, k in KEYS.items()]
    with tempfile.TemporaryDirectory(prefix="r3store-abuse-") as directory:
        process, url = start_server(
            Path(directory),
            {
                "R3STORE_API_KEYS": json.dumps(keys),
                "R3STORE_MAINTENANCE_INTERVAL": "0",
                **(env or {}),
            },
        )
        try:
            with httpx.Client(base_url=url, headers=_auth("admin"), timeout=60) as http:
                for name, spec in SPECS.items():
                    made = http.post("/v1/namespaces", json={"name": name, "spec": spec})
                    assert made.status_code == 201, made.text
            yield Server(url, process.pid)
        finally:
            stop_server(process)


def _connect(server: Server, data: bytes = b"") -> socket.socket | None:
    try:
        sock = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), 5)
        if data:
            sock.sendall(data)
        return sock
    except OSError:
        return None


def _head(method: str, path: str, *lines: str) -> bytes:
    return f"{method} {path} HTTP/1.1\r\nHost: r3store\r\n{''.join(lines)}\r\n".encode()


def _answer(sock: socket.socket, within: float = 3.0) -> str:
    """The status line the server sent, or what happened instead."""
    sock.settimeout(within)
    try:
        data = sock.recv(4096)
    except TimeoutError:
        return "no answer"
    except OSError as exc:
        return type(exc).__name__
    return data.split(b"\r\n", 1)[0].decode("latin-1") if data else "closed"


def _in_threads(n: int, fn: Callable[[int], Any]) -> list[Any]:
    results: list[Any] = [None] * n

    def run(i: int) -> None:
        results[i] = fn(i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


# the attacks: each bounded, each returns what it saw


def unauthenticated_bodies(server: Server) -> dict[str, Any]:
    def send(_: int) -> dict[str, Any]:
        sock = _connect(server, _head("POST", STATS, f"Content-Length: {1 << 30}\r\n"))
        if sock is None:
            return {"answer": "refused"}
        chunk, sent, end = b"{" * MiB, 0, time.monotonic() + 10
        with contextlib.suppress(OSError):
            sock.settimeout(5)
            while sent < 1 << 30 and time.monotonic() < end:
                sock.sendall(chunk)
                sent += len(chunk)
        answer = _answer(sock)
        sock.close()
        return {"answer": answer, "MiB sent": sent // MiB}

    return {"bodies": _in_threads(3, send)}


def big_headers(server: Server) -> dict[str, Any]:
    def send(_: int) -> dict[str, Any]:
        sock = _connect(server, _head("GET", "/healthz")[:-2] + b"X-Big: ")
        if sock is None:
            return {"answer": "refused"}
        chunk, sent, end = b"a" * MiB, 0, time.monotonic() + 20
        with contextlib.suppress(OSError):
            sock.settimeout(5)
            while sent < 48 * MiB and time.monotonic() < end:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b"\r\n\r\n")
        answer = _answer(sock)
        sock.close()
        return {"answer": answer, "MiB sent": sent // MiB}

    return {"headers": _in_threads(3, send)}


def _hold(
    server: Server, count: int, first: bytes, more: bytes | None, seconds: float, every: float
) -> dict[str, Any]:
    """`count` connections that send `first`, then `more` every `every` seconds (while
    the server keeps them) for `seconds`: how many it closed, and when."""
    socks = [s for s in (_connect(server, first) for _ in range(count)) if s is not None]
    opened, closed_at = len(socks), []
    started = time.monotonic()
    end = started + seconds
    live = list(socks)
    while time.monotonic() < end and live:
        time.sleep(every)
        still = []
        for sock in live:
            try:
                sock.setblocking(False)
                try:
                    gone = sock.recv(65536) == b""
                except BlockingIOError:
                    gone = False
                if not gone and more is not None:
                    sock.sendall(more)
            except OSError:
                gone = True
            if gone:
                closed_at.append(time.monotonic() - started)
                sock.close()
            else:
                still.append(sock)
        live = still
    for sock in live:
        sock.close()
    return {
        "opened": opened,
        "closed by the server": len(closed_at),
        "last closed after s": round(max(closed_at), 1) if closed_at else None,
    }


def slow_headers(server: Server) -> dict[str, Any]:
    return _hold(server, 3000, _head("GET", "/healthz")[:-2], b"X-a: b\r\n", 15, 2.0)


def slow_bodies(server: Server) -> dict[str, Any]:
    first = (
        _head(
            "POST",
            "/v1/namespaces/ns/routes/batch",
            "Content-Length: 1000000\r\n",
            f"Authorization: Bearer {KEYS['reader']}\r\n",
            "Content-Type: application/json\r\n",
        )
        + b'{"ids": ['
    )
    return _hold(server, 500, first, b" ", 15, 1.0)


def idle_connections(server: Server) -> dict[str, Any]:
    return _hold(server, 1100, b"", None, 12, 1.0)


def budget_hold(server: Server) -> dict[str, Any]:
    largest = 128 * MiB
    first = _head(
        "POST",
        "/v1/namespaces/ns/trajectories",
        f"Content-Length: {largest}\r\n",
        f"Authorization: Bearer {KEYS['writer']}\r\n",
        f"Content-Type: {CONTENT_TYPE}\r\n",
    )
    holds = [_connect(server, first) for _ in range(2)]
    time.sleep(0.5)
    answers: Counter[int] = Counter()
    rng = np.random.default_rng(0)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        end = time.monotonic() + 12
        i = 0
        while time.monotonic() < end:
            topk = uniform_topk(rng, 99, 4, 64, 4, np.uint8)
            body = encode_writes([TrajectoryWrite(f"b{i}", 100, topk=topk)])
            r = http.post(
                "/v1/namespaces/ns/trajectories",
                content=body,
                headers={**_auth("writer2"), "Content-Type": CONTENT_TYPE},
            )
            answers[r.status_code] += 1
            i += 1
            time.sleep(0.5)
    held = [_answer(s, 20) if s is not None else "refused" for s in holds]
    for s in holds:
        if s is not None:
            s.close()
    return {"other writer's answers": dict(answers), "holders' answers": held}


def version_bomb(server: Server) -> dict[str, Any]:
    topk = np.zeros((1, 4, 4), np.uint8) + np.arange(4, dtype=np.uint8)
    writes = [TrajectoryWrite(f"v{i}", 2, topk=topk, policy_version=1_000 + i) for i in range(2000)]
    out: dict[str, Any] = {}
    with httpx.Client(base_url=server.url, timeout=60) as http:
        started = time.perf_counter()
        r = http.post(
            "/v1/namespaces/ns/trajectories",
            content=encode_writes(writes),
            headers={**_auth("writer"), "Content-Type": CONTENT_TYPE},
        )
        out["upload"] = [r.status_code, round(time.perf_counter() - started, 2)]
        scrapes = []
        for _ in range(5):
            started = time.perf_counter()
            code = http.get("/metrics", headers=_auth("admin")).status_code
            scrapes.append([code, round(time.perf_counter() - started, 2)])
        out["scrapes"] = scrapes
    return out


def _timed_upload(server: Server, namespace: str, body: bytes) -> dict[str, Any]:
    """One writer's upload of `body`: its size, the answer's status and how long it took."""
    with httpx.Client(base_url=server.url, timeout=120) as http:
        started = time.perf_counter()
        r = http.post(
            f"/v1/namespaces/{namespace}/trajectories",
            content=body,
            headers={**_auth("writer"), "Content-Type": CONTENT_TYPE},
        )
        return {
            "body MB": round(len(body) / 1e6, 1),
            "answer": r.status_code,
            "s": round(time.perf_counter() - started, 2),
        }


def many_rows(server: Server) -> dict[str, Any]:
    topk = np.broadcast_to(np.arange(8, dtype=np.uint8), (1, 48, 8))
    body = encode_writes([TrajectoryWrite(f"r{i}", 2, topk=topk) for i in range(100_000)])
    return _timed_upload(server, "large", body)


def amplified_reads(server: Server) -> dict[str, Any]:
    tokens = 64 * MiB // (48 * 16) + 1  # 64 MiB of masks each
    topk = np.broadcast_to(np.arange(8, dtype=np.uint8), (tokens - 1, 48, 8))
    with Client(server.url, KEYS["writer"]) as client:
        for i in range(4):
            client.put("large", [TrajectoryWrite(f"a{i}", tokens, topk=topk)])
    with httpx.Client(base_url=server.url, timeout=120) as http:
        started = time.perf_counter()
        r = http.post(
            "/v1/namespaces/large/routes/batch",
            json={"ids": [f"a{i}" for i in range(4)], "format": "mask"},
            headers=_auth("reader"),
        )
        return {
            "answer": r.status_code,
            "answer MB": round(len(r.content) / 1e6, 1),
            "s": round(time.perf_counter() - started, 2),
        }


def decode_bombs(server: Server) -> dict[str, Any]:
    """32 writers at once, each an upload of four encoded segments that take about 10 kB
    and decode to 64 MiB each; sent again on 429 (as the clients do), for 60 s at most."""
    bodies = [encode_writes(decode_bomb(f"bomb{i}")) for i in range(32)]

    def send(i: int) -> list[int]:
        return post_until_admitted(
            server.url,
            "/v1/namespaces/large/trajectories",
            60,
            120,
            content=bodies[i],
            headers={**_auth("writer"), "Content-Type": CONTENT_TYPE},
        )

    tries = _in_threads(len(bodies), send)
    return {
        "body kB": round(max(len(b) for b in bodies) / 1e3, 1),
        "stored": sum(t[-1] == 200 for t in tries),
        "429 answers": sum(t.count(429) for t in tries),
    }


def unread_answers(server: Server) -> dict[str, Any]:
    """Eight clients each ask for 216 MiB of decoded ids (under the read limit) and read
    none of it, for 15 s."""
    tokens = 24_000
    topk = np.broadcast_to(np.arange(8, dtype=np.uint8), (tokens - 1, 48, 8))
    count = 216 * MiB // (tokens * 48 * 9)
    with Client(server.url, KEYS["writer"]) as client:
        client.put("large", [TrajectoryWrite(f"u{i}", tokens, topk=topk) for i in range(count)])
    body = json.dumps({"ids": [f"u{i}" for i in range(count)], "format": "ids"}).encode()
    request = _head(
        "POST",
        "/v1/namespaces/large/routes/batch",
        f"Authorization: Bearer {KEYS['reader']}\r\n",
        "Content-Type: application/json\r\n",
        f"Content-Length: {len(body)}\r\n",
    )
    socks = []
    for _ in range(8):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", int(server.url.rsplit(":", 1)[1])))
        sock.sendall(request + body)
        socks.append(sock)
    time.sleep(15)
    dropped = 0
    for sock in socks:
        sock.settimeout(5)
        try:
            while sock.recv(1 << 20):
                pass
            dropped += 1  # the server ended it
        except OSError:
            dropped += 1  # reset: the server dropped it
        finally:
            sock.close()
    return {"answer MiB": round(count * tokens * 48 * 9 / MiB), "connections dropped": dropped}


def layer_reads(server: Server) -> dict[str, Any]:
    """32 readers at once, each asking for one layer of 12 trajectories that decode to
    9 MiB each (a few kB on the wire, and under the read limit as decoded: a stage's
    read decodes every segment whole to cut its layer); sent again on 429, for 60 s at
    most."""
    tokens = 24_000
    topk = np.broadcast_to(np.arange(8, dtype=np.uint8), (tokens - 1, 48, 8))
    with Client(server.url, KEYS["writer"]) as client:
        for begin in range(0, 12, 4):
            writes = [TrajectoryWrite(f"l{i}", tokens, topk=topk) for i in range(begin, begin + 4)]
            client.put("large", writes)
    body = {"ids": [f"l{i}" for i in range(12)], "format": "ids", "layers": [0]}

    def read(_: int) -> list[int]:
        path = "/v1/namespaces/large/routes/batch"
        return post_until_admitted(server.url, path, 60, 120, json=body, headers=_auth("reader"))

    tries = _in_threads(32, read)
    finals = [t[-1] for t in tries]
    return {
        "answers": {str(s): finals.count(s) for s in sorted(set(finals))},
        "429 answers": sum(t.count(429) for t in tries),
    }


def wide_schema(server: Server) -> dict[str, Any]:
    topk = np.zeros((1, 4, 4), np.uint8) + np.arange(4, dtype=np.uint8)
    table = pa.ipc.open_stream(encode_writes([TrajectoryWrite("w", 2, topk=topk)])).read_all()
    extra = pa.array([None], pa.int8())
    table = pa.Table.from_arrays(
        [*table.columns, *([extra] * 20_000)],
        names=[*table.column_names, *(f"x{i}" for i in range(20_000))],
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as stream:
        stream.write_table(table)
    body = sink.getvalue().to_pybytes()
    return _timed_upload(server, "ns", body)


def planted_group(server: Server) -> dict[str, Any]:
    topk = np.zeros((1, 4, 4), np.uint8) + np.arange(4, dtype=np.uint8)
    planted: Counter[int] = Counter()
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for part in range(3):
            writes = [
                TrajectoryWrite(f"p{part}-{i}", 2, topk=topk, group_id="planted")
                for i in range(10_000)
            ]
            r = http.post(
                "/v1/namespaces/ns/trajectories",
                content=encode_writes(writes),
                headers={**_auth("writer"), "Content-Type": CONTENT_TYPE},
            )
            planted[r.status_code] += 1
        started = time.perf_counter()
        r = http.post(
            "/v1/namespaces/ns/routes/sample",
            json={"n": 1, "whole_groups": True},
            headers=_auth("reader"),
        )
        return {
            "plant uploads": dict(planted),
            "sample answer": r.status_code,
            "answer MB": round(len(r.content) / 1e6, 2),
            "s": round(time.perf_counter() - started, 2),
        }


CASES: list[tuple[str, Callable[[Server], dict[str, Any]]]] = [
    ("unauthenticated 1 GiB bodies x3", unauthenticated_bodies),
    ("48 MiB header lines x3", big_headers),
    ("slow headers, 3000 connections", slow_headers),
    ("slow JSON bodies, 500 connections", slow_bodies),
    ("idle connections x1100", idle_connections),
    ("budget hold: 2 silent largest uploads", budget_hold),
    ("version bomb: 2000 future versions", version_bomb),
    ("many rows: 100k one-token rows", many_rows),
    ("amplified reads: 4 x 64 MiB masks", amplified_reads),
    ("decode bombs: 32 uploads of 4 x 64 MiB encoded", decode_bombs),
    ("unread answers: 8 x 216 MiB ids", unread_answers),
    ("layer reads: 32 readers of one layer of 12 x 9 MiB", layer_reads),
    ("wide schema: 20k columns", wide_schema),
    ("planted group of 30k, n=1", planted_group),
]


def _open_files() -> None:
    """Enough open files for this process's thousands of connections."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = 8192 if hard == resource.RLIM_INFINITY else min(hard, 8192)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


def run(quick: bool = False) -> tuple[list[Figure], dict[str, object]]:
    """Every case (`quick`: the cheap ones only)."""
    _open_files()
    figures: list[Figure] = []
    details: dict[str, object] = {}
    mib = float(MiB)
    cheap = {"48 MiB header lines x3", "idle connections x1100", "wide schema: 20k columns"}
    for name, attack in CASES:
        if quick and name not in cheap:
            continue
        print(f"  {name} ...", flush=True)
        with serving() as server:
            time.sleep(0.5)
            idle = _rss(server.pid)
            cpu = _cpu_seconds(server.pid)
            with Bystander(server.url) as bystander:
                started = time.perf_counter()
                try:
                    outcome = attack(server)
                except Exception as exc:  # noqa: BLE001 - an attack that broke is a result too
                    outcome = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                seconds = time.perf_counter() - started
                time.sleep(0.5)
            try:
                peak = _status(server.pid, "VmHWM")
                spent = _cpu_seconds(server.pid) - cpu
                after = _rss(server.pid)
                alive = True
            except (OSError, RuntimeError):  # the server died (a zombie has no VmHWM)
                peak, spent, after, alive = 0, float("nan"), 0, False
        worst = max(bystander.times, default=float("nan"))
        figures += [
            Figure(
                f"abuse {name}: server peak RSS",
                peak / mib,
                "MiB",
                idle / mib,
                "idle RSS",
                "< 1024 MiB",
            ),
            Figure(f"abuse {name}: bystander worst /healthz", worst, "s", target="< 1 s"),
            Figure(f"abuse {name}: server CPU", spent, "CPU-s"),
        ]
        details[name] = {
            **outcome,
            "attack s": round(seconds, 1),
            "bystander probes": len(bystander.times),
            "bystander failures": bystander.failures,
            "server RSS after MiB": round(after / mib),
            "server alive": alive,
        }
        print(f"    {json.dumps(details[name])}", flush=True)
    return figures, {"abuse": details}
