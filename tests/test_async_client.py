"""The asyncio client and writer against a real server process on real S3."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest

from helpers import SPEC, make_write
from http_helpers import KEYS, ServerProcess
from r3store.errors import Conflict, InvalidRoutes, NotFound, StoreError
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import uniform_topk
from r3store_client import AsyncClient, AsyncRolloutWriter, Client, Retry, write_calls


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    process = ServerProcess(tmp_path_factory.mktemp("async"), seaweed)
    yield process
    process.stop()


def _client(server: ServerProcess, **options: Any) -> AsyncClient:
    return AsyncClient(server.url, api_key=KEYS["admin"], **options)


def test_the_same_calls_answer_the_same(server: ServerProcess) -> None:
    writes = [make_write(f"a{i}") for i in range(4)]

    async def main() -> None:
        async with _client(server) as client:
            await client.ensure_namespace("same", SPEC)
            await client.ensure_namespace("same", SPEC)  # exists: compared, kept
            with pytest.raises(Conflict, match="top_k 4"):
                await client.ensure_namespace("same", RouteSpec(4, 64, 2))
            results = await client.put("same", writes)
            assert [r.created for r in results] == [True] * 4
            _, batch = await client.fetch("same", ["a2", "nope", "a0"])
            assert batch.missing == ["nope"]
            with Client(server.url, api_key=KEYS["admin"]) as sync:
                _, wanted = sync.fetch("same", ["a2", "nope", "a0"])
                plan = sync.plan("same", ["a1"])
                _, direct = sync.fetch_direct("same", ["a1", "a3"])
            for got, want in zip(batch.items, wanted.items, strict=True):
                assert (got is None) == (want is None)
                if got is not None and want is not None:
                    assert got.routes is not None
                    assert want.routes is not None
                    assert np.array_equal(got.routes.to_topk(), want.routes.to_topk())
            assert (await client.plan("same", ["a1"])).segments == plan.segments
            _, async_direct = await client.fetch_direct("same", ["a1", "a3"])
            assert [s.digest for i in async_direct.found for s in i.segments] == [
                s.digest for i in direct.found for s in i.segments
            ]
            _, mine = await client.resolve([r.ref for r in results[::-1]])
            assert mine.ids == ["a3", "a2", "a1", "a0"]
            with pytest.raises(NotFound):
                await client.namespace("absent")

    asyncio.run(main())


def test_the_event_loop_runs_while_large_uploads_are_encoded(
    server: ServerProcess, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Checking and encoding a 100 MB upload (16 x 4096 tokens, 48 layers, top-8 as
    int32) runs on the client's threads, never on the event loop: other coroutines keep
    being scheduled throughout, also while that work is made to take 0.6 s."""
    spec = RouteSpec(num_layers=48, num_experts=128, top_k=8)
    rng = np.random.default_rng(5)
    writes = [
        TrajectoryWrite(f"big{i}", 4096, topk=uniform_topk(rng, 4095, 48, 128, 8))
        for i in range(16)
    ]
    threads: list[str] = []
    real = write_calls.encoded_writes  # what a put runs first, direct or through the server

    def slow(*args: Any) -> list[TrajectoryWrite]:
        threads.append(threading.current_thread().name)
        started = time.perf_counter()
        encoded = real(*args)
        time.sleep(max(0.0, 0.6 - (time.perf_counter() - started)))  # at least 0.6 s
        return encoded

    monkeypatch.setattr(write_calls, "encoded_writes", slow)

    async def main() -> tuple[float, float]:
        gaps: list[float] = []
        done = asyncio.Event()

        async def tick() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.005)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        async with _client(server) as client:
            await client.ensure_namespace("big", spec)
            ticker = asyncio.create_task(tick())
            started = time.perf_counter()
            results = await client.put("big", writes)
            took = time.perf_counter() - started
            done.set()
            await ticker
        assert all(r.created for r in results)
        return max(gaps), took

    worst, took = asyncio.run(main())
    assert threads == ["r3store-cpu_0"]
    assert took >= 0.6
    assert worst < 0.3, worst  # a loop blocked by the work would wait 0.6 s at least


class _Busy(httpx.AsyncBaseTransport):
    """The real server behind a transport that first answers `times` requests 429
    with Retry-After: 1 (a server shedding load)."""

    def __init__(self, times: int) -> None:
        self.real = httpx.AsyncHTTPTransport()
        self.left = times
        self.seen = 0

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        self.seen += 1
        if self.left:
            self.left -= 1
            return httpx.Response(429, headers={"Retry-After": "1"}, json={"error": {}})
        return await self.real.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


def test_retry_after_is_honoured_and_sampling_is_not_sent_twice(server: ServerProcess) -> None:
    async def main() -> None:
        busy = _Busy(times=1)
        http = httpx.AsyncClient(base_url=server.url, transport=busy)
        async with _client(server, http=http, retry=Retry(attempts=3, backoff=0.01)) as client:
            started = time.perf_counter()
            await client.ensure_namespace("busy", SPEC)
            assert time.perf_counter() - started >= 1.0  # waited the server's Retry-After
            assert busy.seen == 3  # GET (429), GET again (404), POST
            busy.left, busy.seen = 1, 0
            with pytest.raises(Exception, match="429"):
                await client.sample("busy", 1)  # not idempotent: answered, not retried
            assert busy.seen == 1
        await http.aclose()
        gone = AsyncClient("http://127.0.0.1:9", retry=Retry(attempts=2, backoff=0.01))
        with pytest.raises(StoreError, match="unreachable"):
            await gone.namespace("x")
        await gone.aclose()

    asyncio.run(main())


def test_the_async_writer_batches_concurrent_puts_and_hands_out_refs(
    server: ServerProcess,
) -> None:
    writes = [make_write(f"w{i}") for i in range(40)]
    bad = TrajectoryWrite("bad", 10, topk=np.zeros((9, SPEC.num_layers, 2), np.int32))

    async def main() -> None:
        async with _client(server) as client:
            await client.ensure_namespace("writer", SPEC)
            puts = 0
            real = client.put

            async def counted(*args: Any) -> Any:
                nonlocal puts
                puts += 1
                return await real(*args)

            client.put = counted  # type: ignore[method-assign]
            writer = AsyncRolloutWriter(client, "writer", batch_size=8, linger=0.2)
            async with writer:
                refs = await asyncio.gather(*(writer.put(w) for w in writes))
                with pytest.raises(InvalidRoutes, match="bad"):
                    await writer.put(bad)
                late = await writer.submit(make_write("late"))
            assert late.done()
            assert late.result().trajectory_id == "late"
            assert [r.trajectory_id for r in refs] == [w.trajectory_id for w in writes]
            assert puts < len(writes) // 2  # sent together, 8 at a time
            assert writer.report.sent == 41
            assert list(writer.report.failed) == ["bad"]
            client.put = real  # type: ignore[method-assign]
            _, batch = await client.resolve(refs)
            assert batch.ids == [w.trajectory_id for w in writes]

    asyncio.run(main())


def test_the_async_writer_waits_out_an_outage_and_reports_what_it_could_not_send(
    tmp_path: Any,
) -> None:
    async def main() -> None:
        client = AsyncClient("http://127.0.0.1:9", retry=Retry(attempts=1))
        client._specs["down"] = SPEC  # the spec known already: only uploads fail
        writer = AsyncRolloutWriter(client, "down", retry_backoff=0.05, linger=0.01)
        pending = await writer.submit(make_write("lost"))
        assert not await writer.flush(timeout=0.5)  # still retrying
        report = await writer.close(timeout=0.1)
        assert report.unsent == ["lost"]
        with pytest.raises(StoreError, match="not sent"):
            pending.result()
        await client.aclose()

    asyncio.run(main())
