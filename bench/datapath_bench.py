"""The trainer's data path at the speed of the storage, on SeaweedFS, beside the naive
baseline (one `.npy` of uint8 ids per trajectory, boto3, 8 threads) in the same run:

- HTTP ingest of int32 engine output (what SGLang emits) from 8 client threads, the
  client encoding: written directly to the object store (the default on S3: the server
  only checks and commits) and through the server, one trajectory a put and a group of
  4, with the server's CPU time per token-layer of each; direct puts of one trajectory
  each sent alone (`put_lanes=None`) beside the client's lanes (the default); and ids
  sent as they are;
- `TrainerReader` into compact tensors ready for replay, through the server and
  directly from the object store (batches of 32, two micro-batches ahead), with the
  server's CPU time per token-layer of each and the reader's peak memory;
- the wide int32 tensors the reader built before, for comparison.
"""

from __future__ import annotations

import json
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import psutil

from bench.engine_bench import READ_BATCH, SPEC, THREADS, Workload, naive
from bench.figures import Figure, median_of, timed
from r3store.records import TrajectoryWrite
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.service import start_server, stop_server
from r3store_client import Client
from r3store_client.reader import TrainerReader
from r3store_client.tensors import CompactRoutes

KEY = "bench-admin-key-0123456789abcdef"
RATE = "M token-layers/s"


class PeakRss:
    """The highest resident memory of this process while the block runs, sampled."""

    def __init__(self) -> None:
        self.process = psutil.Process()
        self.peak = 0
        self._stop = threading.Event()

    def __enter__(self) -> PeakRss:
        self.before = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self.process.memory_info().rss)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _server_cpu(pid: int) -> float:
    times = psutil.Process(pid).cpu_times()
    return float(times.user + times.system)


def run(seaweed: SeaweedFS, count: int = 256, tokens: int = 4096) -> list[Figure]:
    work = Workload(count, tokens)
    n = work.token_layers
    engine_output = [a.astype(np.int32) for a in work.arrays]  # as SGLang emits them
    probe = seaweed.new_store()
    naive_ingest, naive_read, _ = naive(probe._client, probe.bucket, work)
    naive_in, naive_out = n / naive_ingest / 1e6, n / naive_read / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="r3store-datapath-"))
    env = {
        "R3STORE_API_KEYS": json.dumps([{"name": "bench", "role": "admin", "key": KEY}]),
        **seaweed.server_env(probe.config.prefix),
    }
    probe.close()
    process, url = start_server(tmp, env)
    try:
        with (
            Client(url, api_key=KEY) as client,
            Client(url, KEY, direct_writes=False) as proxy,
            Client(url, KEY, encode=False) as plain,
            Client(url, KEY, put_lanes=None) as alone,
        ):

            def ingest(
                through: Client, namespace: str, per_request: int = 1
            ) -> tuple[float, float]:
                """(seconds, server CPU seconds) of writing the workload into a new
                namespace."""
                through.create_namespace(namespace, SPEC)

                def put(first: int) -> None:
                    writes = [
                        TrajectoryWrite(
                            work.ids[i], tokens, topk=engine_output[i % len(engine_output)]
                        )
                        for i in range(first, min(first + per_request, len(work.ids)))
                    ]
                    through.put(namespace, writes)

                starts = range(0, len(work.ids), per_request)
                cpu = _server_cpu(process.pid)
                with ThreadPoolExecutor(THREADS) as pool:
                    seconds = timed(lambda: list(pool.map(put, starts)))
                return seconds, _server_cpu(process.pid) - cpu

            direct_in, direct_cpu_in = ingest(client, "bench-direct")
            alone_in, alone_cpu_in = ingest(alone, "bench-direct-alone")
            proxied_in, proxied_cpu_in = ingest(proxy, "bench-proxied")
            ids_in, _ = ingest(plain, "bench-ids")
            grouped_direct, grouped_direct_cpu = ingest(client, "bench-direct-4", per_request=4)
            grouped_in, grouped_cpu = ingest(proxy, "bench-grouped", per_request=4)
            batches = [work.ids[i : i + READ_BATCH] for i in range(0, len(work.ids), READ_BATCH)]

            def read(reader: TrainerReader, after: Callable[[object], object] = id) -> float:
                def run_once() -> None:
                    for routes in reader.iterate(batches):
                        after(routes)

                return timed(run_once)

            def measured(reader: TrainerReader) -> tuple[float, float, float]:
                """(median seconds, server CPU seconds per pass, peak RSS growth)."""
                cpu = _server_cpu(process.pid)
                with PeakRss() as rss:
                    seconds = median_of(3, lambda: read(reader))
                used = (_server_cpu(process.pid) - cpu) / 3
                return seconds, used, (rss.peak - rss.before) / 2**20

            proxied, proxied_cpu, proxied_rss = measured(
                TrainerReader(client, "bench-direct", depth=2)
            )
            direct, direct_cpu, direct_rss = measured(
                TrainerReader(client, "bench-direct", depth=2, direct=True)
            )
            wide = median_of(3, lambda: read(TrainerReader(client, "bench-direct", compact=False)))
            widened = median_of(
                3,
                lambda: read(
                    TrainerReader(client, "bench-direct", depth=2, direct=True),
                    lambda r: r.widen() if isinstance(r, CompactRoutes) else r,
                ),
            )
    finally:
        stop_server(process)
    return [
        Figure("datapath: naive .npy/boto3 x8 on SeaweedFS: ingest (uint8)", naive_in, RATE),
        Figure("datapath: naive .npy/boto3 x8 on SeaweedFS: read (uint8)", naive_out, RATE),
        Figure(
            "direct writes of int32 engine output, 8 threads, client encodes",
            n / direct_in / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
            ">= 1.0x",
        ),
        Figure(
            "direct writes of int32 engine output, 8 threads, each put alone",
            n / alone_in / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
        ),
        Figure(
            "direct writes of int32 engine output, 8 threads x 4 a put",
            n / grouped_direct / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
        ),
        Figure(
            "HTTP ingest of int32 engine output, 8 threads, client encodes",
            n / proxied_in / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
        ),
        Figure(
            "HTTP ingest of int32 engine output, 8 threads x 4 a request, encoded",
            n / grouped_in / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
        ),
        Figure(
            "HTTP ingest of int32 engine output, 8 threads, ids as sent",
            n / ids_in / 1e6,
            RATE,
            naive_in,
            "naive uint8 write",
        ),
        Figure(
            "server CPU per token-layer written, direct",
            direct_cpu_in / n * 1e9,
            "ns",
            proxied_cpu_in / n * 1e9,
            "through the server",
            "<= 0.2x",
        ),
        Figure(
            "server CPU per token-layer written, direct, each put alone",
            alone_cpu_in / n * 1e9,
            "ns",
            proxied_cpu_in / n * 1e9,
            "through the server",
        ),
        Figure(
            "server CPU per token-layer written, direct, 4 a put",
            grouped_direct_cpu / n * 1e9,
            "ns",
            grouped_cpu / n * 1e9,
            "through the server, 4 a request",
        ),
        Figure(
            "TrainerReader to compact tensors, through the server",
            n / proxied / 1e6,
            RATE,
            naive_out,
            "naive uint8 read",
            ">= 1.0x",
        ),
        Figure(
            "TrainerReader to compact tensors, direct from the store",
            n / direct / 1e6,
            RATE,
            naive_out,
            "naive uint8 read",
            ">= 1.0x",
        ),
        Figure(
            "TrainerReader direct, then widened on the CPU",
            n / widened / 1e6,
            RATE,
            naive_out,
            "naive uint8 read",
        ),
        Figure(
            "TrainerReader to wide int32 tensors on the host (before)",
            n / wide / 1e6,
            RATE,
            naive_out,
            "naive uint8 read",
        ),
        Figure(
            "server CPU per token-layer read, direct",
            direct_cpu / n * 1e9,
            "ns",
            proxied_cpu / n * 1e9,
            "through the server",
            "<= 0.2x",
        ),
        Figure("reader peak RSS growth, through the server", proxied_rss, "MiB"),
        Figure("reader peak RSS growth, direct", direct_rss, "MiB"),
    ]
