"""What a request costs the server, apart from the routes it carries: its CPU time per
request of the small routes (`/healthz`, an authenticated namespace read, a blob's
upload URL), one client after another, and per direct put of a 64-token trajectory
from 8 writers sharing a client (about the fixed cost of one trajectory a put), in the
client's lanes beside each put sent alone, on SeaweedFS.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import psutil

from bench.engine_bench import SPEC, THREADS, Workload
from bench.figures import Figure
from r3store.records import TrajectoryWrite
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.service import start_server, stop_server
from r3store_client import Client

KEY = "bench-admin-key-0123456789abcdef"


def _cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def run(seaweed: SeaweedFS, requests: int = 400, puts: int = 256) -> list[Figure]:
    probe = seaweed.new_store()
    env = {
        "R3STORE_API_KEYS": json.dumps([{"name": "bench", "role": "admin", "key": KEY}]),
        **seaweed.server_env(probe.config.prefix),
    }
    probe.close()
    process, url = start_server(Path(tempfile.mkdtemp(prefix="r3store-requests-")), env)
    figures = []
    try:
        spec = {"num_layers": SPEC.num_layers, "num_experts": SPEC.num_experts, "top_k": SPEC.top_k}
        headers = {"Authorization": f"Bearer {KEY}"}
        with httpx.Client(base_url=url, headers=headers, timeout=60) as http:
            http.post("/v1/namespaces", json={"name": "req", "spec": spec}).raise_for_status()
            plans = [http.post("/v1/namespaces/req/writes", json={}).json() for _ in range(100)]

            def upload(i: int) -> httpx.Response:
                body = {"plan": plans[i % len(plans)]["plan"], "size": 1000}
                return http.post("/v1/namespaces/req/writes/upload", json=body)

            cases: list[tuple[str, Callable[[int], httpx.Response]]] = [
                ("/healthz", lambda i: http.get("/healthz")),
                ("an authenticated namespace read", lambda i: http.get("/v1/namespaces/req")),
                ("a blob's upload URL", upload),
            ]
            for name, call in cases:
                before = _cpu(process.pid)
                for i in range(requests):
                    call(i).raise_for_status()
                spent = (_cpu(process.pid) - before) / requests
                figures.append(Figure(f"server CPU per request: {name}", spent * 1e3, "ms"))
        work = Workload(puts, 64)
        routes = [a.astype(np.int32) for a in work.arrays]
        spent = {}
        for lanes in (None, 2):  # each put alone, then in the client's lanes (the default)
            namespace = f"puts-{lanes}"
            with Client(url, api_key=KEY, put_lanes=lanes) as client:
                client.create_namespace(namespace, SPEC)
                client.put(namespace, [TrajectoryWrite("warm", work.tokens, topk=routes[0])])

                def put(i: int, client: Client = client, namespace: str = namespace) -> None:
                    write = TrajectoryWrite(work.ids[i], work.tokens, topk=routes[i % len(routes)])
                    client.put(namespace, [write])

                before = _cpu(process.pid)
                with ThreadPoolExecutor(THREADS) as pool:
                    list(pool.map(put, range(puts)))
                spent[lanes] = (_cpu(process.pid) - before) / puts * 1e3
        figures.append(
            Figure(
                "server CPU per direct put of 64 tokens, 8 writers",
                spent[2],
                "ms",
                spent[None],
                "each put alone",
            )
        )
    finally:
        stop_server(process)
    return figures
