"""The trainer side: each rank fetches only its micro-batches, the next ones while the
current one computes (torch required).

    reader = TrainerReader(client, "run1")            # compact routes, one batch ahead
    replayer = RouterReplay(model)                    # r3store_client.replay
    mine = rank_slice(global_ids, rank, world_size)
    for routes in reader.iterate(micro_batches(mine, 4)):
        with replayer.replay(routes.to("cuda")):      # widened on the GPU
            loss = model(...)

A micro-batch arrives as `CompactRoutes`: the server's stored streams, decoded on the
client's threads straight into buffers of 1 byte a slot (uint8 ids up to 256 experts)
plus counts; moved to the device as they are, widened there by the replay paths
(`compact=False`: int32 ids and a validity mask on the host, as `padded` makes them).
Each micro-batch carries the token ids stored with its routes and the trajectory ids,
for the replay paths' token check.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from r3store.protocol.wire import ReadFormat
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client.client import Client
from r3store_client.extras import missing

try:
    import torch  # noqa: F401  (the error names this module, not tensors)
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc
from r3store_client.tensors import (
    CompactRoutes,
    Layout,
    Major,
    RouteTensors,
    compact,
    no_layers,
)


class TrainerReader:
    """Micro-batches of one namespace's routes for a trainer rank.

    `layout`: `padded` `[B, T, L, K]` or `packed` `[N, L, K]` with `cu_seqlens`;
    `major`: the storage order of the compact buffers (`layer`: each MoE layer's slice
    contiguous, as routers read them); `pin`: page-locked buffers for asynchronous
    copies; `depth`: micro-batches fetched ahead by `iterate`; `direct`: read the bytes
    from the object store itself, the server only planning the read (S3-backed servers
    whose store the trainer can reach); `layers`: only those of the namespace's layers
    travel (a pipeline stage's, `MegatronReplay.needed_layers`), through the server: a
    direct read fetches whole segments, so `direct=True` with layers is refused here.
    No layers (a stage of dense layers only) reads nothing: micro-batches named by refs
    get routes of no layer, as long as the refs say, without a round trip.
    Micro-batches are named by trajectory ids or by route refs (`r3store.refs`).
    """

    def __init__(
        self,
        client: Client,
        namespace: str,
        layout: Layout = "padded",
        pin: bool = False,
        include_stale: bool = False,
        on_event: Callable[[str, int], None] | None = None,
        *,
        compact: bool = True,
        major: Major = "layer",
        depth: int = 1,
        direct: bool = False,
        layers: Sequence[int] | None = None,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be at least 1, got {depth}")
        if direct and layers:
            raise ValueError(
                "a direct read fetches whole stored segments, not some layers: read a "
                "stage's layers through the server (direct=False), or drop layers (the "
                "replay takes its own layers out of whole routes)"
            )
        self.client = client
        self.namespace = namespace
        self.layout = layout
        self.pin = pin
        self.include_stale = include_stale
        self.compact = compact
        self.major = major
        self.depth = depth
        self.direct = direct
        self.layers = None if layers is None else list(layers)
        self._on_event = on_event or (lambda _what, _index: None)
        self._spec: RouteSpec | None = None
        self._lock = threading.Lock()

    def fetch(self, ids: Sequence[str] | Sequence[RouteRef]) -> CompactRoutes | RouteTensors:
        """One micro-batch's routes, in the order of `ids`: trajectory ids (`KeyError`
        names missing or stale ones) or route refs (resolved: `RefMismatch` names a ref
        that no longer resolves)."""
        if self.layers == []:
            return self._nothing(ids)
        if ids and all(isinstance(i, RouteRef) for i in ids):
            refs = [i for i in ids if isinstance(i, RouteRef)]
            spec, batch = self.client.resolve(refs, self.include_stale, self.direct, self.layers)
        elif self.direct:
            names = [str(i) for i in ids]
            spec, batch = self.client.fetch_direct(self.namespace, names, self.include_stale)
        else:
            names = [str(i) for i in ids]
            spec, batch = self.client.fetch(
                self.namespace,
                names,
                self.include_stale,
                ReadFormat.ENCODED,
                decode=False,
                layers=self.layers,
            )
        with self._lock:
            self._spec = spec
        routes = compact(
            batch,
            spec,
            self.layout,
            self.major,
            pin=self.pin and self.compact,
            executor=self.client.decoders,
            namespace=self.namespace,
        )
        if self.compact:
            return routes
        wide = routes.widen()
        return wide.pin_memory() if self.pin else wide

    def _nothing(self, ids: Sequence[str] | Sequence[RouteRef]) -> CompactRoutes | RouteTensors:
        """A read of no layers: nothing travels; refs say how long each sequence is."""
        refs = [i for i in ids if isinstance(i, RouteRef)]
        if len(refs) != len(ids):
            raise ValueError(
                "a read of no layers (layers=[]) names its micro-batches by route refs, "
                "whose token counts it needs without reading: trajectory ids would need "
                "a round trip"
            )
        routes = no_layers(
            [r.num_tokens for r in refs],
            [r.trajectory_id for r in refs],
            self.layout,
            self.namespace,
        )
        return routes if self.compact else routes.widen()

    def iterate(
        self,
        batches: Sequence[Sequence[str]] | Sequence[Sequence[RouteRef]],
        depth: int | None = None,
    ) -> Iterator[CompactRoutes | RouteTensors]:
        """Yield each micro-batch's routes in order, keeping `depth` (default: the
        reader's) fetches going ahead of the caller, no more: however slow the caller,
        memory holds those `depth` and the ones the caller still refers to (in a plain
        `for` loop, the current and, while the next is handed over, the previous)."""
        ahead_n = self.depth if depth is None else depth
        if ahead_n < 1:
            raise ValueError(f"depth must be at least 1, got {ahead_n}")
        if not batches:
            return

        def load(index: int) -> CompactRoutes | RouteTensors:
            self._on_event("fetch_start", index)
            try:
                return self.fetch(batches[index])
            finally:
                self._on_event("fetch_end", index)

        with ThreadPoolExecutor(ahead_n, thread_name_prefix="r3store-prefetch") as ahead:
            pending: deque[Future[CompactRoutes | RouteTensors]] = deque()
            for index in range(len(batches)):
                while len(pending) < ahead_n and index + len(pending) < len(batches):
                    pending.append(ahead.submit(load, index + len(pending)))
                current = pending.popleft().result()
                if index + 1 + len(pending) < len(batches):  # refill the slot it freed
                    pending.append(ahead.submit(load, index + 1 + len(pending)))
                self._on_event("yield", index)
                yield current
