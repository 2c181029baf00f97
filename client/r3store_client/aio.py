"""The asyncio client and rollout writer, for rollout loops that are coroutines.

    async with AsyncClient(url, api_key=key) as client:
        await client.ensure_namespace("run1", spec)
        async with AsyncRolloutWriter(client, "run1") as writer:
            ref = await writer.put(write)        # stored durably; batched with others

Every call is the sync client's own (`r3store_client.calls`): the same requests,
retries (idempotent calls only; 429/503 `Retry-After` honoured), validation, answer
parsing and errors. Only the transport differs: requests go through
`httpx.AsyncClient`, and the CPU work (checking and encoding uploads, decoding answers)
and the object store's blocking ranged reads run on threads this client owns
(`workers`), so the event loop keeps running the rollout's other coroutines while
100 MB of routes are encoded and sent. A client belongs to the event loop it was first
used in; make one per loop (per Ray actor).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import urllib3

from r3store.errors import Backpressure, R3StoreError
from r3store.records import TrajectoryWrite
from r3store.refs import RouteRef
from r3store_client.call_base import Retry, Transport, awaiting
from r3store_client.calls import Calls
from r3store_client.steps import Call, Send, Sleep, Step, Stepper, T, Wait
from r3store_client.writer import (
    Pause,
    Pending,
    Writer,
    WriterReport,
    write_size,
)

__all__ = ["AsyncClient", "AsyncRolloutWriter"]


class AsyncClient(Calls, Transport[httpx.AsyncClient]):
    """`Client`'s calls as coroutines; see `r3store_client.client.Client` for each."""

    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8330",
        api_key: str | None = None,
        *,
        http: httpx.AsyncClient | None = None,
        timeout: float | httpx.Timeout = 60.0,
        retry: Retry | None = None,
        encode: bool = True,
        store_http: urllib3.PoolManager | None = None,
        workers: int = 2,
        direct_writes: bool | None = None,
        put_lanes: int | None = 2,
    ) -> None:
        super().__init__(
            base_url, api_key, timeout, retry, encode, store_http, direct_writes, put_lanes
        )
        self._connect(http)
        self.workers = workers
        self._cpu: ThreadPoolExecutor | None = None

    @property
    def http(self) -> httpx.AsyncClient:
        return self._opened(httpx.AsyncClient)

    @property
    def cpu(self) -> ThreadPoolExecutor:
        """The threads that run this client's CPU work off the event loop."""
        with self._made:
            if self._cpu is None:
                self._cpu = ThreadPoolExecutor(self.workers, thread_name_prefix="r3store-cpu")
            return self._cpu

    async def aclose(self) -> None:
        if self._http is not None and self._own_http:
            await self._http.aclose()
        self._http = None
        if self._cpu is not None:
            self._cpu.shutdown(wait=False)
            self._cpu = None
        self._close_pools()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    def _unpicklable(self) -> tuple[str, ...]:
        return (*super()._unpicklable(), "_cpu")

    async def _run(self, call: Call[T]) -> T:
        """Run a call's steps: requests and sleeps awaited, CPU work on `cpu`."""
        steps = Stepper(call)
        try:
            for step in steps:
                try:
                    steps.answer(await self._outcome(step))
                except Exception as exc:  # noqa: BLE001  (the call raises it, or retries)
                    steps.fail(exc)
        finally:
            call.close()
        return steps.result

    async def _outcome(self, step: Step) -> Any:
        """What a step comes to: the response, the work's result, None after a sleep."""
        if isinstance(step, Send):
            return await self.http.request(step.method, step.path, **step.kwargs)
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Wait):
            waits = [asyncio.wrap_future(f) for f in step.futures]
            await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            return None
        return await asyncio.get_running_loop().run_in_executor(self.cpu, step.fn, *step.args)

    request = awaiting(Calls._request)

    # namespaces
    create_namespace = awaiting(Calls._create_namespace)
    namespace = awaiting(Calls._namespace)
    ensure_namespace = awaiting(Calls._ensure_namespace)
    spec = awaiting(Calls._spec)
    set_policy_version = awaiting(Calls._set_policy_version)
    update_settings = awaiting(Calls._update_settings)

    # data
    put = awaiting(Calls._put)
    get_batch = awaiting(Calls._get_batch)
    fetch = awaiting(Calls._fetch)
    token_ids = awaiting(Calls._token_ids)
    plan = awaiting(Calls._plan)
    fetch_direct = awaiting(Calls._fetch_direct)
    resolve = awaiting(Calls._resolve)
    sample = awaiting(Calls._sample)

    # leases, checkpoints and resume (r3store_client.lease_calls)

    lease = awaiting(Calls._lease)
    read_lease = awaiting(Calls._read_lease)
    commit = awaiting(Calls._commit)
    release = awaiting(Calls._release)
    renew = awaiting(Calls._renew)
    get_lease = awaiting(Calls._get_lease)
    leases = awaiting(Calls._leases)
    checkpoint = awaiting(Calls._checkpoint)
    checkpoints = awaiting(Calls._checkpoints)
    delete_checkpoint = awaiting(Calls._delete_checkpoint)
    resume = awaiting(Calls._resume)

    # statistics
    expert_load = awaiting(Calls._expert_load)
    agreement = awaiting(Calls._agreement)
    drift = awaiting(Calls._drift)
    trajectory_loads = awaiting(Calls._trajectory_loads)


class AsyncRolloutWriter(Writer[AsyncClient, asyncio.Future[RouteRef]]):
    """`RolloutWriter` for coroutines: concurrent `put`s are sent together in batches
    by one background task, memory bounded by `max_pending_bytes` (`submit` waits, or
    raises `Backpressure` with `block=False`). Refusals, retries, logging and the report
    are `RolloutWriter`'s (`writer.Delivery`)."""

    def _start(self) -> None:
        """The condition writes wait on; the task that sends them starts with the first."""
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    async def submit(
        self, trajectory: TrajectoryWrite, block: bool = True, timeout: float | None = None
    ) -> asyncio.Future[RouteRef]:
        """Queue one trajectory (or appended segment); waits only while the queue is
        full. The future's result is its route ref once stored."""
        size = write_size(trajectory)
        async with self._changed:
            if self._held.closing:
                raise R3StoreError("the writer is closed")
            if not self._held.room(size):
                if not block:
                    raise Backpressure("the writer's queue is full")
                if not await self._until(lambda: self._held.room(size), timeout):
                    raise Backpressure("the writer's queue stayed full")
            if self._task is None:
                self._task = asyncio.get_running_loop().create_task(self._run())
            pending = Pending(trajectory, size, asyncio.get_running_loop().create_future())
            self._held.add(pending)
            self._changed.notify_all()
        return pending.future

    async def put(self, trajectory: TrajectoryWrite) -> RouteRef:
        """Queue one trajectory and wait until it is stored: its route ref (a refusal
        raises). Cancelling the wait leaves the write queued."""
        return await asyncio.shield(await self.submit(trajectory))

    async def flush(self, timeout: float | None = None) -> bool:
        """Wait until everything queued is acknowledged or refused; False on timeout."""
        async with self._changed:
            self._changed.notify_all()
            return await self._until(self._held.idle, timeout)

    async def close(self, timeout: float | None = 60.0) -> WriterReport:
        """Send what is queued (up to `timeout` seconds), stop, and return the report."""
        await self.flush(timeout)
        async with self._changed:
            self._held.close()
            self._changed.notify_all()
        if self._task is not None:
            await self._task
        self._delivery.unsent(self._held.drain())
        return self.report

    async def __aenter__(self) -> AsyncRolloutWriter:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _take(self) -> list[Pending[asyncio.Future[RouteRef]]] | None:
        held = self._held
        async with self._changed:
            await self._changed.wait_for(lambda: bool(held.items) or held.closing)
            if not held.items:
                return None
            if held.gathering():
                await self._until(lambda: not held.gathering(), held.linger)  # a batch gathers
            return held.take()

    async def _run(self) -> None:
        while True:
            batch = await self._take()
            if batch is None:
                return
            leftover = await self._send(batch)
            async with self._changed:
                self._held.returned(batch, leftover)
                self._changed.notify_all()
            if leftover:
                return

    async def _until(self, predicate: Callable[[], bool], timeout: float | None) -> bool:
        """Wait (holding `_changed`) until `predicate()`; False when `timeout` passed."""
        try:
            await asyncio.wait_for(self._changed.wait_for(predicate), timeout)
        except TimeoutError:
            return False
        return True

    def _give_up(self) -> bool:
        return self._held.give_up()

    async def _send(self, batch: list[Pending[Any]]) -> list[Pending[Any]]:
        """Deliver a batch; returns what could not be sent before closing."""
        steps = Stepper(self._delivery.deliver(batch, self._give_up))
        for step in steps:
            if isinstance(step, Pause):
                async with self._changed:  # a wait that close() cuts short
                    await self._until(lambda: self._held.closing, step.seconds)
                continue
            try:
                steps.answer(await self.client.put(self.namespace, step.writes))
            except R3StoreError as exc:
                steps.fail(exc)
        return steps.result
