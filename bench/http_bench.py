"""HTTP ingest and batch reads through a real server process, beside the in-process
engine on the same kind of store, measured in the same run."""

from __future__ import annotations

import json
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from bench.engine_bench import READ_BATCH, THREADS, Workload, ours
from bench.figures import Figure, median_of, timed
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, encode_writes
from r3store.records import TrajectoryWrite
from r3store.storage.store import LocalStore
from r3store.testing.service import start_server, stop_server
from r3store_client import Client
from r3store_client.reader import TrainerReader

KEY = "bench-admin-key-0123456789abcdef"
SPEC_JSON = {"num_layers": 48, "num_experts": 128, "top_k": 8}


def run(count: int = 256, tokens: int = 4096) -> list[Figure]:
    work = Workload(count, tokens)
    n = work.token_layers
    tmp = Path(tempfile.mkdtemp(prefix="r3store-http-"))
    local = ours(lambda: LocalStore(tmp / "inproc"), work, tmp)
    env = {"R3STORE_API_KEYS": json.dumps([{"name": "bench", "role": "admin", "key": KEY}])}
    process, url = start_server(tmp / "served", env)
    headers = {"Authorization": f"Bearer {KEY}"}
    try:
        with httpx.Client(base_url=url, headers=headers, timeout=120) as http:
            http.post(
                "/v1/namespaces", json={"name": "bench", "spec": SPEC_JSON}
            ).raise_for_status()
            bodies = [
                encode_writes([TrajectoryWrite(tid, tokens, topk=work.routes(i))])
                for i, tid in enumerate(work.ids)
            ]

            def put(body: bytes) -> None:
                r = http.post(
                    "/v1/namespaces/bench/trajectories",
                    content=body,
                    headers={"Content-Type": CONTENT_TYPE},
                )
                r.raise_for_status()

            with ThreadPoolExecutor(THREADS) as pool:
                ingest = timed(lambda: list(pool.map(put, bodies)))
            batches = [work.ids[i : i + READ_BATCH] for i in range(0, len(work.ids), READ_BATCH)]

            def fetch(ids: list[str]) -> bytes:
                r = http.post("/v1/namespaces/bench/routes/batch", json={"ids": ids})
                r.raise_for_status()
                return r.content

            client = Client(url, api_key=KEY)
            decoders = client.decoders  # decoding as the client does it, on its threads

            def read_all(decode: bool) -> None:
                for ids in batches:
                    batch = decode_batch(fetch(ids), decode=decode, executor=decoders)[1]
                    assert not batch.missing

            def read_prefetched() -> None:
                """Fetch the next batch while this one decodes, as a trainer's loader does."""
                with ThreadPoolExecutor(1) as ahead:
                    pending = ahead.submit(fetch, batches[0])
                    for i in range(len(batches)):
                        body = pending.result()
                        if i + 1 < len(batches):
                            pending = ahead.submit(fetch, batches[i + 1])
                        assert not decode_batch(body, executor=decoders)[1].missing

            reader = TrainerReader(client, "bench", layout="padded")

            def read_tensors() -> None:
                for ids in batches:
                    routes = reader.fetch(ids)
                    assert routes.ids.shape[0] == len(ids)

            tensors = median_of(3, lambda: timed(read_tensors))
            read = median_of(3, lambda: timed(lambda: read_all(True)))
            prefetched = median_of(3, lambda: timed(read_prefetched))
            raw = median_of(3, lambda: timed(lambda: read_all(False)))
            client.close()
    finally:
        stop_server(process)
    rate = "M token-layers/s"
    return [
        Figure(
            "HTTP ingest, 8 clients, local store",
            n / ingest / 1e6,
            rate,
            n / local["ingest"] / 1e6,
            "in-process engine",
        ),
        Figure(
            "HTTP batch read of 32, decoded by the client",
            n / read / 1e6,
            rate,
            n / local["warm"] / 1e6,
            "in-process engine (decoded)",
            ">= 0.5x",
        ),
        Figure(
            "HTTP batch read of 32, decoded, next batch prefetched",
            n / prefetched / 1e6,
            rate,
            n / local["warm"] / 1e6,
            "in-process engine (decoded)",
            ">= 0.5x",
        ),
        Figure(
            "client reader: request to padded torch tensors, batches of 32",
            n / tensors / 1e6,
            rate,
            n / raw / 1e6,
            "raw HTTP read (stored streams)",
        ),
        Figure(
            "HTTP batch read of 32, stored streams",
            n / raw / 1e6,
            rate,
            n / local["warm"] / 1e6,
            "in-process engine (decoded)",
        ),
    ]
