"""Asyncio ingest beside threaded ingest, against the same server process in one run.

A rollout loop's finished trajectories (engine output: int32 top-k ids, a
Qwen3-30B-A3B-like spec, 48 layers, top-8 of 128, uniform routes) stored by
`concurrency` producers at once, each waiting for its trajectory's durable ack before
the next, as a rollout worker does:

- asyncio: one `AsyncClient` and one `AsyncRolloutWriter`, `concurrency` coroutines
  each `await writer.put(...)` (route refs back);
- threaded: one `Client` and one `RolloutWriter`, `concurrency` threads each
  `writer.write(...).result()`.

Both writers batch what is queued (16 trajectories, 32 MiB a request). MB/s counts the
routes as the engine emitted them (int32 ids: 4 bytes a slot); the figures are medians
over repeats, the two ways alternating (which goes first alternating too), fresh
trajectory ids every time.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import numpy.typing as npt

from bench.figures import Figure
from r3store.records import TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store.testing.service import start_server, stop_server
from r3store.testing.synthetic import uniform_topk

KEY = "bench-admin-key-0123456789abcdef"
NAMESPACE = "asyncbench"
SPEC = RouteSpec(48, 128, 8)
POOL = 16  # distinct routes, reused under fresh ids (memory stays small)


def _writes(pool: Sequence[npt.NDArray[np.int32]], count: int, tag: str) -> list[TrajectoryWrite]:
    return [
        TrajectoryWrite(f"{tag}/t{i}", pool[i % len(pool)].shape[0], topk=pool[i % len(pool)])
        for i in range(count)
    ]


def _asyncio_ingest(url: str, writes: list[TrajectoryWrite], concurrency: int) -> float:
    from r3store_client import AsyncClient, AsyncRolloutWriter

    async def main() -> float:
        async with AsyncClient(url, api_key=KEY) as client:
            await client.ensure_namespace(NAMESPACE, SPEC)
            queue = list(reversed(writes))
            refs: list[RouteRef] = []

            async def producer(writer: AsyncRolloutWriter) -> None:
                while queue:
                    refs.append(await writer.put(queue.pop()))

            started = time.perf_counter()
            async with AsyncRolloutWriter(client, NAMESPACE) as writer:
                await asyncio.gather(*(producer(writer) for _ in range(concurrency)))
            seconds = time.perf_counter() - started
            if writer.report.failed or len(refs) != len(writes):
                raise AssertionError(f"asyncio ingest lost writes: {writer.report}")
            return seconds

    return asyncio.run(main())


def _threaded_ingest(url: str, writes: list[TrajectoryWrite], concurrency: int) -> float:
    from r3store_client import Client, RolloutWriter

    with Client(url, api_key=KEY) as client:
        client.ensure_namespace(NAMESPACE, SPEC)
        queue = list(reversed(writes))
        refs: list[RouteRef] = []

        def producer(writer: RolloutWriter) -> None:
            while True:
                try:
                    write = queue.pop()
                except IndexError:
                    return
                refs.append(writer.write(write).result())

        started = time.perf_counter()
        with RolloutWriter(client, NAMESPACE) as writer, ThreadPoolExecutor(concurrency) as pool:
            for done in [pool.submit(producer, writer) for _ in range(concurrency)]:
                done.result()
        seconds = time.perf_counter() - started
        if writer.report.failed or len(refs) != len(writes):
            raise AssertionError(f"threaded ingest lost writes: {writer.report}")
        return seconds


def run(quick: bool = False) -> list[Figure]:
    count, tokens = (48, 1024) if quick else (192, 4096)
    repeats = 3 if quick else 5
    concurrency = 32
    rng = np.random.default_rng(0)
    pool = [uniform_topk(rng, tokens, SPEC.num_layers, SPEC.num_experts, SPEC.top_k)]
    pool += [uniform_topk(rng, tokens, 48, 128, 8) for _ in range(POOL - 1)]
    mb = count * tokens * SPEC.num_layers * SPEC.top_k * 4 / 1e6
    tmp = Path(tempfile.mkdtemp(prefix="r3store-async-"))
    env = {"R3STORE_API_KEYS": json.dumps([{"name": "bench", "role": "admin", "key": KEY}])}
    process, url = start_server(tmp, env)
    ways = {"asyncio": _asyncio_ingest, "threaded": _threaded_ingest}
    seconds: dict[str, list[float]] = {way: [] for way in ways}
    try:
        for repeat in range(repeats + 1):  # the first is a warm-up
            order = list(ways) if repeat % 2 else list(reversed(ways))
            for way in order:
                writes = _writes(pool, count, f"r{repeat}/{way}")
                elapsed = ways[way](url, writes, concurrency)
                if repeat:
                    seconds[way].append(elapsed)
    finally:
        stop_server(process)
    median = {way: statistics.median(s) for way, s in seconds.items()}
    what = f"async ingest {count}x{tokens}: AsyncRolloutWriter, {concurrency} tasks"
    threads = f"RolloutWriter, {concurrency} threads"
    return [
        Figure(what, mb / median["asyncio"], "MB/s (int32)", mb / median["threaded"], threads),
        Figure(
            what, count / median["asyncio"], "trajectories/s", count / median["threaded"], threads
        ),
    ]
