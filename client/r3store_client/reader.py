"""The trainer side: each rank fetches only its micro-batches, the next one while the
current one computes (torch required).

    reader = TrainerReader(client, "run1", layout="padded")
    replayer = RouterReplay(model)                    # r3store_client.replay
    mine = rank_slice(global_ids, rank, world_size)
    for routes in reader.iterate(micro_batches(mine, 4)):
        with replayer.replay(routes.to("cuda")):
            loss = model(...)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Literal

from r3store.spec import RouteSpec
from r3store.wire import ReadFormat
from r3store_client.client import Client
from r3store_client.extras import missing

try:
    import torch  # noqa: F401  (the error names this module, not tensors)
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc
from r3store_client.tensors import RouteTensors, packed, padded

Layout = Literal["padded", "packed"]


class TrainerReader:
    def __init__(
        self,
        client: Client,
        namespace: str,
        layout: Layout = "padded",
        pin: bool = False,
        include_stale: bool = False,
        on_event: Callable[[str, int], None] | None = None,
    ) -> None:
        self.client = client
        self.namespace = namespace
        self.layout = layout
        self.pin = pin
        self.include_stale = include_stale
        self._on_event = on_event or (lambda _what, _index: None)
        self._spec: RouteSpec | None = None
        self._lock = threading.Lock()

    def fetch(self, ids: Sequence[str]) -> RouteTensors:
        """One micro-batch's routes, in `ids` order; `KeyError` names missing or stale ids."""
        spec, batch = self.client.fetch(self.namespace, ids, self.include_stale, ReadFormat.ENCODED)
        with self._lock:
            self._spec = spec
        if self.layout == "packed":
            return packed(batch, spec, pin=self.pin)
        return padded(batch, spec, pin=self.pin)

    def iterate(self, batches: Sequence[Sequence[str]]) -> Iterator[RouteTensors]:
        """Yield each micro-batch's routes, fetching the next while the caller computes."""
        if not batches:
            return
        with ThreadPoolExecutor(1, thread_name_prefix="r3store-prefetch") as ahead:

            def load(index: int) -> RouteTensors:
                self._on_event("fetch_start", index)
                try:
                    return self.fetch(batches[index])
                finally:
                    self._on_event("fetch_end", index)

            pending: Future[RouteTensors] = ahead.submit(load, 0)
            for index in range(len(batches)):
                current = pending.result()
                if index + 1 < len(batches):
                    pending = ahead.submit(load, index + 1)
                self._on_event("yield", index)
                yield current
