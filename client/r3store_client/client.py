"""A synchronous client over httpx.

    client = Client("http://r3store:8330", api_key=os.environ["R3STORE_KEY"])
    refs = [r.ref for r in client.put("run1", [TrajectoryWrite("p0/s0", 4096, topk=ids)])]
    batch = client.get_batch("run1", ["p0/s0"])
    spec, mine = client.resolve(refs)                 # route refs, checked (`r3store.refs`)

Pass `http=httpx.Client(transport=httpx.ASGITransport(app))`-style clients in tests.
What each call sends, how it is retried and how its answer is read is shared with
`AsyncClient` (`r3store_client.calls`); this module only runs the calls, blocking.
Uploads are encoded here, with the engine's own validation and codec (a rollout worker's
CPU instead of the server's, and about six times fewer bytes than int32 ids on the
wire); the server checks the streams by decoding them. `encode=False` sends the ids as
they are; either way the client checks each array's shape against the namespace's spec
first (its bytes alone would fit a transposed array). A pickled client (DataLoader
workers) drops its connection and opens a new one on first use.
"""

from __future__ import annotations

import time
from concurrent import futures
from typing import Any

import httpx
import urllib3

from r3store_client.call_base import Retry, Transport, blocking
from r3store_client.calls import Calls
from r3store_client.steps import Call, Send, Sleep, Step, Stepper, T, Wait
from r3store_client.write_calls import check_shape

__all__ = ["Client", "Retry", "check_shape"]


class Client(Calls, Transport[httpx.Client]):
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8330",
        api_key: str | None = None,
        *,
        http: httpx.Client | None = None,
        timeout: float | httpx.Timeout = 60.0,
        retry: Retry | None = None,
        encode: bool = True,
        store_http: urllib3.PoolManager | None = None,
        direct_writes: bool | None = None,
        put_lanes: int | None = 2,
    ) -> None:
        super().__init__(
            base_url, api_key, timeout, retry, encode, store_http, direct_writes, put_lanes
        )
        self._connect(http)

    # connection

    @property
    def http(self) -> httpx.Client:
        return self._opened(httpx.Client)

    def close(self) -> None:
        if self._http is not None and self._own_http:
            self._http.close()
        self._http = None
        self._close_pools()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, call: Call[T]) -> T:
        """Run a call's steps in this thread."""
        steps = Stepper(call)
        try:
            for step in steps:
                try:
                    steps.answer(self._outcome(step))
                except Exception as exc:  # noqa: BLE001  (the call raises it, or retries)
                    steps.fail(exc)
        finally:
            call.close()
        return steps.result

    def _outcome(self, step: Step) -> Any:
        """What a step comes to: the response, the work's result, None after a sleep."""
        if isinstance(step, Send):
            return self.http.request(step.method, step.path, **step.kwargs)
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Wait):
            futures.wait(step.futures, return_when=futures.FIRST_COMPLETED)
            return None
        return step.fn(*step.args)

    request = blocking(Calls._request)

    # namespaces
    create_namespace = blocking(Calls._create_namespace)
    namespace = blocking(Calls._namespace)
    ensure_namespace = blocking(Calls._ensure_namespace)
    spec = blocking(Calls._spec)
    set_policy_version = blocking(Calls._set_policy_version)
    update_settings = blocking(Calls._update_settings)

    # data
    put = blocking(Calls._put)
    get_batch = blocking(Calls._get_batch)
    fetch = blocking(Calls._fetch)
    token_ids = blocking(Calls._token_ids)
    plan = blocking(Calls._plan)
    fetch_direct = blocking(Calls._fetch_direct)
    resolve = blocking(Calls._resolve)
    sample = blocking(Calls._sample)

    # leases, checkpoints and resume (r3store_client.lease_calls)

    lease = blocking(Calls._lease)
    read_lease = blocking(Calls._read_lease)
    commit = blocking(Calls._commit)
    release = blocking(Calls._release)
    renew = blocking(Calls._renew)
    get_lease = blocking(Calls._get_lease)
    leases = blocking(Calls._leases)
    checkpoint = blocking(Calls._checkpoint)
    checkpoints = blocking(Calls._checkpoints)
    delete_checkpoint = blocking(Calls._delete_checkpoint)
    resume = blocking(Calls._resume)

    # statistics
    expert_load = blocking(Calls._expert_load)
    agreement = blocking(Calls._agreement)
    drift = blocking(Calls._drift)
    trajectory_loads = blocking(Calls._trajectory_loads)
