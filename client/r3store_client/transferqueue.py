"""r3store as a TransferQueue storage backend (TransferQueue 0.1.11, the transport of
verl 0.9's default trainer): routes go to r3store, every other field to an inner
TransferQueue backend (its own SimpleStorage unless configured otherwise).

Importing this module registers the backend under the name `R3Store` (verl imports it in
every process through the `verl.plugins` entry point; any other TransferQueue user
imports it before `tq.init`). Chosen by configuration alone:

    transfer_queue:
      backend:
        storage_backend: R3Store
        R3Store:
          url: http://r3store:8330       # or R3STORE_URL; the key from R3STORE_API_KEY
          namespace: run1
          spec: {num_layers: 48, num_experts: 128, top_k: 8}   # created ordered if absent

A put stores each sample's routes as a trajectory (its token ids from `input_ids`, its
group from `uid`, its prompt length and policy version from the tags `prompt_len` and
`global_steps`) through the asyncio client, durably, before the controller is told the
field is ready; the controller keeps each sample's ref (`tq_samples.SampleMeta`). A get
resolves only the samples asked for, checks them against their refs, and answers the
tensors SimpleStorage would: jagged, in the dtype and shape they were put. A clear
consumes them (leased by name and committed), a checkpoint records an r3store step
checkpoint beside TransferQueue's, and loading it resumes the namespace there
(docs/integrations.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import torch
from tensordict import TensorDict
from transfer_queue.metadata import BatchMeta, extract_field_schema
from transfer_queue.storage.bootstrap.provider import StorageBootstrapProvider
from transfer_queue.storage.managers.base import StorageManager, StorageManagerFactory
from transfer_queue.storage.managers.simple_storage_manager import AsyncSimpleStorageManager

from r3store.errors import InvalidSpec, R3StoreError
from r3store.records import TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client.aio import AsyncClient
from r3store_client.tensors import CompactRoutes, compact
from r3store_client.tq_samples import (
    SampleMeta,
    describe,
    new_trajectory_id,
    per_sample,
    read_dtype,
    sample_tensors,
    sample_write,
    turn_writes,
)
from r3store_client.turn_routes import TurnsMeta

__all__ = ["NAME", "BackendSettings", "R3StoreManager"]

log = logging.getLogger(__name__)

NAME = "R3Store"
CHECKPOINT_FILE = "r3store.json"  # in TransferQueue's checkpoint directory
PUT_CHUNK = 64  # writes per upload (a sample's turns are never split)
CONSUME_SECONDS = 60.0  # the lease a clear takes and commits at once
TIMEOUT = 60.0  # seconds, of each request to r3store


@dataclass(frozen=True)
class BackendSettings:
    """The backend's section, `transfer_queue.backend.R3Store` (secrets come from the
    environment: TransferQueue and verl log the whole configuration)."""

    url: str
    namespace: str
    fields: tuple[str, ...] = ("routed_experts",)
    inner: str = "SimpleStorage"
    spec: RouteSpec | None = None
    api_key_env: str = "R3STORE_API_KEY"
    direct_reads: bool = False

    @classmethod
    def of(cls, section: Mapping[str, Any]) -> BackendSettings:
        url = section.get("url") or os.environ.get("R3STORE_URL")
        namespace = section.get("namespace")
        if not url or not namespace:
            raise InvalidSpec(
                f"transfer_queue.backend.{NAME} needs a url (or R3STORE_URL) and a namespace"
            )
        spec = section.get("spec")
        return cls(
            url=str(url),
            namespace=str(namespace),
            fields=tuple(str(f) for f in section.get("fields") or cls.fields),
            inner=str(section.get("inner") or cls.inner),
            spec=None if not spec else RouteSpec(**{**dict(spec), "ordered": True}),
            api_key_env=str(section.get("api_key_env") or cls.api_key_env),
            direct_reads=bool(section.get("direct_reads", False)),
        )


def bootstrap(conf: Any) -> Any:
    """TransferQueue's storage bootstrap for `R3Store`, in the process that starts
    TransferQueue: the inner backend's own bootstrap runs as if it were chosen (its
    storage units, its addresses in its own section), and that section is kept in
    ours for every process's manager. The inner resources are registered under the
    inner backend's name, so that `tq.close()` shuts them down as its own."""
    import transfer_queue.interface as tq_interface

    settings = BackendSettings.of(conf.backend[NAME])
    conf.backend.storage_backend = settings.inner
    try:
        provider = StorageBootstrapProvider.get_provider(settings.inner)
        resources = None if provider is None else provider(conf)
    finally:
        conf.backend.storage_backend = NAME
    conf.backend[NAME].inner_config = conf.backend[settings.inner]
    if resources is not None:
        tq_interface._TQ_STORAGE[settings.inner] = resources
    return resources


class R3StoreManager(StorageManager):  # type: ignore[misc]
    """The manager in each TransferQueue client process: routes to r3store, the other
    fields to the inner backend's manager, which also owns the controller connection."""

    def __init__(self, controller_info: Any, config: Any, zmq_context: Any = None) -> None:
        # no StorageManager.__init__: the inner manager makes the one handshake
        self.config = config
        self.settings = BackendSettings.of(config)
        self.inner = StorageManagerFactory.create(
            self.settings.inner, controller_info, config["inner_config"], zmq_context=zmq_context
        )
        self.zmq_context = self.inner.zmq_context
        self.storage_manager_id = f"{NAME}_{self.inner.storage_manager_id}"
        self._clients: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncClient]
        self._clients = weakref.WeakKeyDictionary()
        self._spec: RouteSpec | None = None

    # the clients: one per event loop (TransferQueue calls a manager from several)

    def _client(self) -> AsyncClient:
        loop = asyncio.get_running_loop()
        client = self._clients.get(loop)
        if client is None:
            # no connection kept between requests: TransferQueue may end this loop
            # before `close`, and a kept one could then be closed on no loop
            http = httpx.AsyncClient(
                base_url=self.settings.url,
                timeout=TIMEOUT,
                limits=httpx.Limits(max_keepalive_connections=0),
            )
            key = os.environ.get(self.settings.api_key_env)
            client = AsyncClient(self.settings.url, api_key=key, http=http, timeout=TIMEOUT)
            self._clients[loop] = client
        return client

    async def _namespace_spec(self, client: AsyncClient) -> RouteSpec:
        if self._spec is None:
            ns = self.settings.namespace
            if self.settings.spec is not None:
                await client.ensure_namespace(ns, self.settings.spec)
            spec = await client.spec(ns)
            if not spec.ordered and spec.top_k > 1:
                raise InvalidSpec(
                    f"namespace {ns!r} keeps each token's experts sorted (ordered=False): "
                    "TransferQueue must read back the order that was put; use a namespace "
                    "created with ordered=True"
                )
            self._spec = spec
        return self._spec

    # TransferQueue's calls

    async def put_data(
        self, data: TensorDict, metadata: BatchMeta, data_parser: Any = None
    ) -> None:
        names = list(data.keys())  # a TensorDict answers no `in`
        routes = [f for f in self.settings.fields if f in names]
        rest = [f for f in names if f not in routes]
        work = []  # at once: the inner backend's put while the routes encode
        if rest:
            work.append(self.inner.put_data(data.select(*rest), metadata, data_parser=data_parser))
        if routes:
            work.append(self._put_routes(data, metadata, routes))
        await asyncio.gather(*work)

    async def _put_routes(self, data: TensorDict, metadata: BatchMeta, routes: list[str]) -> None:
        """The route fields stored, then the controller told they are ready, with each
        sample's meta."""
        stored = await self._store(data, metadata, routes)
        await self.inner.notify_data_update(
            metadata.partition_ids[0],
            metadata.global_indexes,
            extract_field_schema(data.select(*routes)),
            stored,
        )

    async def _store(
        self, data: TensorDict, metadata: BatchMeta, routes: Sequence[str]
    ) -> dict[int, dict[str, Any]]:
        """Each sample's route fields stored, acknowledged durably; their metas by
        global index."""
        client = self._client()
        spec = await self._namespace_spec(client)
        tokens = _column(data, "input_ids")
        groups = _column(data, "uid")
        extras = _column(data, "extra_fields")
        tags = list(metadata.custom_meta or [{}] * len(metadata.global_indexes))
        metas: dict[int, dict[str, Any]] = {gi: {} for gi in metadata.global_indexes}
        samples: list[list[TrajectoryWrite]] = []  # each sample's writes (one, or its turns)
        owners = []
        for field in routes:
            for i, (gi, value) in enumerate(
                zip(metadata.global_indexes, per_sample(data[field], field), strict=True)
            ):
                meta = describe(value, field)
                metas[gi][field] = meta.to_backend()
                if meta.shape[0] == 0:
                    continue
                tag = tags[i] or {}
                whole = sample_write(
                    new_trajectory_id(metadata.partition_ids[i]),
                    value,
                    spec,
                    token_ids=None if tokens is None else tokens[i],
                    prompt_len=_int(tag.get("prompt_len")),
                    group_id=None if groups is None else str(groups[i]),
                    policy_version=_int(tag.get("global_steps")),
                )
                made = turn_writes(whole, None if extras is None else TurnsMeta.of(extras[i]))
                samples.append(made)
                owners.append((gi, field, meta, len(made)))
        refs: list[RouteRef] = []
        for part in _chunks(samples):
            refs += [result.ref for result in await client.put(self.settings.namespace, part)]
        for gi, field, meta, count in owners:
            ref, refs = RouteRef.joined(refs[:count]), refs[count:]
            metas[gi][field] = SampleMeta(ref.to_json(), meta.dtype, meta.shape).to_backend()
        return metas

    async def get_data(self, metadata: BatchMeta) -> TensorDict:
        routes = [f for f in metadata.field_names if f in self.settings.fields]
        rest = [f for f in metadata.field_names if f not in routes]
        values: dict[str, Any] = {}

        async def inner() -> None:
            got = await self.inner.get_data(metadata.select_fields(rest))
            values.update({f: got[f] for f in rest})

        async def resolve(field: str) -> None:
            values[field] = await self._resolve(metadata, field)

        # at once: the inner backend's read while the routes are fetched and decoded (a
        # failure raises as itself; what runs beside it finishes, its answer dropped)
        await asyncio.gather(*([inner()] if rest else []), *map(resolve, routes))
        return TensorDict({f: values[f] for f in metadata.field_names}, batch_size=len(metadata))

    async def _resolve(self, metadata: BatchMeta, field: str) -> Any:
        """The samples' tensors of `field`, read by their refs (only these samples),
        packed as SimpleStorage packs a field."""
        metas = [
            SampleMeta.from_backend((m or {}).get(field), field)
            for m in metadata._custom_backend_meta
        ]
        refs = [ref for ref in (m.route_ref() for m in metas) if ref is not None]
        if not refs:
            return _packed(metas, None, field)
        client = self._client()
        spec, batch = await client.resolve(refs, direct=self.settings.direct_reads)
        dtype = read_dtype(metas, spec)
        decoders = client.decoders  # taken here, on the loop, not by the thread below

        def unpack() -> Any:  # off the event loop, the trajectories decoded in parallel
            routes = compact(
                batch,
                spec,
                "packed",
                major="token",
                executor=decoders,
                namespace=refs[0].namespace,
                dtype=dtype,
            )
            return _packed(metas, routes, field)

        return await asyncio.to_thread(unpack)

    async def clear_data(self, metadata: BatchMeta) -> None:
        """The samples are consumed: their trajectories leased by name and committed
        (retention may drop them after, as the namespace's settings say). A failure is
        logged, not raised: TransferQueue would leave the samples half cleared."""
        try:
            ids = sorted(
                {
                    ref.trajectory_id
                    for m in metadata._custom_backend_meta or []
                    for field, value in (m or {}).items()
                    if field in self.settings.fields
                    for ref in [SampleMeta.from_backend(value, field).route_ref()]
                    if ref is not None
                }
            )
            if ids:
                client = self._client()
                ns = self.settings.namespace
                lease = await client.lease(ns, trajectory_ids=ids, seconds=CONSUME_SECONDS)
                await client.commit(lease)
        except R3StoreError as exc:
            log.error("r3store could not count cleared samples consumed: %s", exc)
        await self.inner.clear_data(metadata)

    async def save_checkpoint(self, checkpoint_dir: str) -> None:
        """The inner backend's checkpoint, and an r3store step checkpoint of the
        namespace's consumption, named in `r3store.json` beside it."""
        await self.inner.save_checkpoint(checkpoint_dir)
        client = self._client()
        ns = self.settings.namespace
        _epoch, kept = await client.checkpoints(ns)
        step = max((c.step for c in kept), default=0) + 1
        await client.checkpoint(ns, step)
        record = {"url": self.settings.url, "namespace": ns, "step": step}
        Path(checkpoint_dir, CHECKPOINT_FILE).write_text(json.dumps(record))

    async def load_checkpoint(self, checkpoint_dir: str) -> None:
        """The namespace's consumption back to the checkpoint's step (what was consumed
        after it is available again), then the inner backend's checkpoint."""
        record = json.loads(Path(checkpoint_dir, CHECKPOINT_FILE).read_text())
        if record["namespace"] != self.settings.namespace:
            raise InvalidSpec(
                f"the checkpoint in {checkpoint_dir} is of namespace {record['namespace']!r}, "
                f"not {self.settings.namespace!r}"
            )
        await self._client().resume(record["namespace"], int(record["step"]))
        await self.inner.load_checkpoint(checkpoint_dir)

    def can_destroy_zmq_context(self) -> bool:
        return bool(self.inner.can_destroy_zmq_context())

    def close(self) -> None:
        """Close the inner manager and every client this one opened: on the client's
        own loop where it still runs, else on a loop of its own (TransferQueue ends its
        loop before calling this; no connection outlives a request)."""
        for loop, client in list(self._clients.items()):
            try:
                if loop.is_running() and _running_loop() is loop:
                    loop.create_task(_aclose(client))
                elif loop.is_running():
                    asyncio.run_coroutine_threadsafe(_aclose(client), loop).result(10)
                elif not loop.is_closed():
                    loop.run_until_complete(_aclose(client))
                else:
                    asyncio.run(_aclose(client))
            except Exception as exc:  # noqa: BLE001 (closing goes on with the others)
                log.warning("closing an r3store client failed: %s", exc)
        self._clients.clear()
        self.inner.close()

    def __del__(self) -> None:
        pass  # StorageManager's closes; `close` is called explicitly


async def _aclose(client: AsyncClient) -> None:
    http = client._http
    await client.aclose()
    if http is not None:
        await http.aclose()


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _chunks(samples: list[list[TrajectoryWrite]]) -> list[list[TrajectoryWrite]]:
    """The samples' writes in puts of about `PUT_CHUNK` writes, a sample's turns always
    in one put: all of a sample stored, or none of it."""
    out: list[list[TrajectoryWrite]] = []
    for writes in samples:
        if not out or (out[-1] and len(out[-1]) + len(writes) > PUT_CHUNK):
            out.append([])
        out[-1].extend(writes)
    return out


def _packed(metas: list[SampleMeta], routes: CompactRoutes | None, field: str) -> Any:
    """The samples' tensors of `field`, packed as SimpleStorage packs a field."""
    return AsyncSimpleStorageManager._pack_field_values(sample_tensors(metas, routes, field))


def _column(data: TensorDict, name: str) -> list[Any] | None:
    """A field of the put, one value per sample, when it has one."""
    if name not in list(data.keys()):
        return None
    value = data[name]
    if isinstance(value, torch.Tensor):
        return list(per_sample(value, name))
    return list(value)  # a NonTensorStack reads as a list: one object per sample


def _int(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


StorageManagerFactory.register(NAME)(R3StoreManager)
StorageBootstrapProvider.register_provider(NAME)(bootstrap)
