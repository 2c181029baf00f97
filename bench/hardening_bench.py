"""Hostile uploads and memory under load, against a real server process.

- fuzz: thousands of mutated Arrow bodies (`r3store.testing.arrow_fuzz`), judged by
  `r3store.testing.upload_fuzz`: counts of 4xx, 5xx and process deaths (goal: 0, 0).
- upload memory: 8 concurrent 200 MB uploads (each 16 trajectories of 32K tokens as
  uint8 ids, the costliest to validate per byte); the server's peak RSS (`VmHWM`) beside
  its idle RSS, and RSS afterwards. The clients retry 429s as the memory budget asks.
"""

from __future__ import annotations

import json
import tempfile
import threading
import time
from pathlib import Path

import httpx
import numpy as np

from bench.figures import Figure
from r3store.protocol.wire import encode_writes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.arrow_fuzz import FUZZ_SPEC, RandomChooser
from r3store.testing.service import start_server, stop_server
from r3store.testing.synthetic import uniform_topk
from r3store.testing.upload_fuzz import UploadJudge, campaign
from r3store_client import Client
from r3store_client.client import Retry

MB = 1_000_000
KEY = "bench-admin-key-0123456789abcdef"
KEYS = json.dumps([{"name": "admin", "role": "admin", "key": KEY}])


def _status(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} for process {pid}")


def fuzz(cases: int, seed: int = 1) -> tuple[list[Figure], dict[str, object]]:
    with tempfile.TemporaryDirectory(prefix="r3store-fuzz-") as directory:
        process, url = start_server(Path(directory), {"R3STORE_API_KEYS": KEYS})
        judge = UploadJudge(url, KEY, "fuzz", FUZZ_SPEC, process)
        try:
            spec = {"num_layers": 2, "num_experts": 16, "top_k": 2}
            judge.http.post("/v1/namespaces", json={"name": "fuzz", "spec": spec})
            started = time.perf_counter()
            tally = campaign(judge, RandomChooser(seed), cases)
            seconds = time.perf_counter() - started
        finally:
            judge.close()
            stop_server(process)
    summary = tally.summary()
    figures = [
        Figure("fuzz: hostile upload bodies sent", tally.cases, "cases", target=">= 5000"),
        Figure("fuzz: answered 4xx (refused, nothing stored)", summary["4xx"], "cases"),
        Figure("fuzz: accepted and read back exactly", summary["accepted"], "cases"),
        Figure("fuzz: answered 5xx", summary["5xx"], "cases", target="0"),
        Figure("fuzz: server process deaths", summary["process_deaths"], "cases", target="0"),
        Figure(
            "fuzz: wrong stores, changes by refusals, dropped connections",
            summary["wrong_content_stored"]
            + summary["rejections_that_changed_something"]
            + summary["dropped_connections"],
            "cases",
            target="0",
        ),
        Figure("fuzz: rate", tally.cases / seconds, "cases/s"),
    ]
    return figures, {**summary, "mutations": dict(tally.mutations)}


def upload_memory(uploads: int = 8, body_bytes: int = 200 * MB) -> list[Figure]:
    """Each upload: 32K-token trajectories of a Qwen3-30B-A3B-shaped namespace (48
    layers, top-8 of 128) as uint8 ids, `body_bytes` of them."""
    spec = RouteSpec(48, 128, 8)
    tokens = 32768
    per = (tokens - 1) * spec.num_layers * spec.top_k
    rng = np.random.default_rng(0)
    pool = [uniform_topk(rng, tokens - 1, 48, 128, 8, np.uint8) for _ in range(4)]
    per_upload = max(1, round(body_bytes / per))
    bodies = [
        encode_writes(
            [
                TrajectoryWrite(f"u{i}/t{j}", tokens, topk=pool[j % len(pool)])
                for j in range(per_upload)
            ]
        )
        for i in range(uploads)
    ]
    with tempfile.TemporaryDirectory(prefix="r3store-upmem-") as directory:
        process, url = start_server(
            Path(directory),
            {
                "R3STORE_API_KEYS": KEYS,
                "R3STORE_MAINTENANCE_INTERVAL": "0",
                # one key sends all 8: the budget is theirs, and the body may be 200 MB
                "R3STORE_MAX_BODY_BYTES": str(256 << 20),
                "R3STORE_UPLOAD_MEMORY_PER_KEY": str(768 << 20),
            },
        )
        try:
            client = Client(url, KEY, retry=Retry(attempts=200, backoff=0.2, max_backoff=1.0))
            client.create_namespace("mem", spec)
            time.sleep(1.0)
            idle = _status(process.pid, "VmRSS")
            refused = []
            lock = threading.Lock()

            def count(response: httpx.Response) -> None:
                if response.status_code == 429:
                    with lock:
                        refused.append(1)

            def upload(body: bytes) -> None:
                with httpx.Client(
                    base_url=url, timeout=300, event_hooks={"response": [count]}
                ) as http:
                    own = Client(url, KEY, http=http, retry=client.retry)
                    response = own.request(
                        "POST",
                        "/v1/namespaces/mem/trajectories",
                        content=body,
                        headers={"Content-Type": "application/vnd.apache.arrow.stream"},
                    )
                    assert response.status_code == 200

            started = time.perf_counter()
            threads = [threading.Thread(target=upload, args=(b,)) for b in bodies]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            seconds = time.perf_counter() - started
            peak = _status(process.pid, "VmHWM")
            time.sleep(3.0)
            after = _status(process.pid, "VmRSS")
            stored = client.namespace("mem").trajectories
            client.close()
        finally:
            stop_server(process)
    assert stored == uploads * per_upload, stored
    mib = 2**20
    return [
        Figure(
            f"server peak RSS, {uploads} concurrent {len(bodies[0]) // MB} MB uploads",
            peak / mib,
            "MiB",
            idle / mib,
            "idle RSS",
            "< 1024 MiB",
        ),
        Figure("  server RSS 3 s after the uploads", after / mib, "MiB", idle / mib, "idle RSS"),
        Figure("  uploads answered 429 and retried", len(refused), "answers"),
        Figure("  time to acknowledge all of them", seconds, "s"),
    ]


def run(quick: bool = False) -> tuple[list[Figure], dict[str, object]]:
    figures, detail = fuzz(300 if quick else 5000)
    figures += upload_memory(2, 20 * MB) if quick else upload_memory(8, 200 * MB)
    return figures, {"fuzz": detail}
