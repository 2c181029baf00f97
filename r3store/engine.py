"""The engine: validated, durable, group-committed writes and batched reads.

    engine = Engine(LocalStore("data/objects"), Catalog("sqlite:///data/catalog.db"))
    engine.create_namespace("run1", RouteSpec(num_layers=48, num_experts=128, top_k=8))
    engine.put("run1", [TrajectoryWrite("t0", num_tokens=4096, topk=ids)])
    batch = engine.get_batch("run1", ["t0", "t1"])   # batch.missing == ["t1"]

`put` returns only once the shard is stored and the catalog committed. It is safe to
call from many threads at once; the engine packs concurrent calls into shared shards.
"""

from __future__ import annotations

import hashlib
import json
import struct
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from r3store import codec
from r3store.catalog import Catalog, NamespaceInfo
from r3store.errors import Conflict, InvalidInput, NotFound, ObjectExists
from r3store.reader import ReaderConfig, ShardReader
from r3store.records import (
    Batch,
    PutResult,
    TrajectoryRead,
    TrajectoryWrite,
    check_id,
    check_namespace,
)
from r3store.routes import Routes, from_mask, from_topk
from r3store.shard import ShardRow
from r3store.spec import RouteSpec
from r3store.store.base import ObjectStore
from r3store.writer import GroupCommitter, WriterConfig

NAMESPACE_PREFIX = "namespaces/"


@dataclass(frozen=True)
class EngineConfig:
    writer: WriterConfig = field(default_factory=WriterConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    compression_level: int = codec.DEFAULT_LEVEL


def namespace_key(name: str) -> str:
    return f"{NAMESPACE_PREFIX}{name}.json"


def _salt(write: TrajectoryWrite) -> bytes:
    """The metadata that is part of a trajectory's content digest."""
    group = (write.group_id or "").encode()
    head = struct.pack(
        "<qqqB", write.num_tokens, write.prompt_len, write.policy_version, write.group_id is None
    )
    return head + hashlib.sha256(group).digest()


class Engine:
    def __init__(
        self, store: ObjectStore, catalog: Catalog, config: EngineConfig | None = None
    ) -> None:
        self.store = store
        self.catalog = catalog
        self.config = config or EngineConfig()
        self._reader = ShardReader(store, self.config.reader)
        self._writer = GroupCommitter(
            store, catalog, self.config.writer, on_shard=self._reader.remember
        )
        self._specs: dict[str, RouteSpec] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        """Commit what is pending, then stop the threads and release connections."""
        self._writer.flush()
        self._writer.close()
        self._reader.close()
        self.catalog.close()
        self.store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_stats(self) -> object:
        return self._writer.stats

    # namespaces

    def create_namespace(self, name: str, spec: RouteSpec) -> NamespaceInfo:
        """Create a namespace (one RL run) with its fixed route spec.

        The spec is written to the object store first (create-only), so a catalog
        rebuild finds namespaces that hold no shards yet. The same call again is a
        no-op; another spec under the same name is a `Conflict`.
        """
        check_namespace(name)
        created = time.time()
        manifest = json.dumps(
            {"name": name, "spec": json.loads(spec.to_json()), "created_at": created}
        )
        try:
            self.store.put_if_absent(namespace_key(name), manifest.encode())
        except ObjectExists:
            stored = json.loads(self.store.get(namespace_key(name)))
            if RouteSpec(**stored["spec"]) != spec:
                raise Conflict(f"namespace {name!r} exists with another route spec") from None
            created = float(stored["created_at"])
        return self.catalog.create_namespace(name, spec, created)

    def namespace(self, name: str) -> NamespaceInfo:
        return self.catalog.namespace(check_namespace(name))

    def spec(self, name: str) -> RouteSpec:
        with self._lock:
            spec = self._specs.get(name)
        if spec is None:
            spec = self.namespace(name).spec
            with self._lock:
                self._specs[name] = spec
        return spec

    # writes

    @staticmethod
    def prepare_routes(spec: RouteSpec, write: TrajectoryWrite) -> Routes:
        """Validate one trajectory against `spec` and return its canonical routes."""
        write.check()
        try:
            if write.topk is not None:
                return from_topk(write.topk, spec, write.num_tokens)
            return from_mask(write.mask, spec, write.num_tokens)
        except InvalidInput as exc:
            raise type(exc)(f"{write.trajectory_id}: {exc}") from None

    def prepare(self, spec: RouteSpec, write: TrajectoryWrite) -> ShardRow:
        """Validate and encode one trajectory (pure CPU work, done in the caller's thread)."""
        routes = self.prepare_routes(spec, write)
        encoded = codec.encode(routes, spec, self.config.compression_level, salt=_salt(write))
        return ShardRow(
            trajectory_id=write.trajectory_id,
            group_id=write.group_id,
            policy_version=write.policy_version,
            num_tokens=write.num_tokens,
            prompt_len=write.prompt_len,
            digest=encoded.digest,
            routes=encoded,
        )

    def put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> list[PutResult]:
        """Store trajectories durably; all of them or, on any error, none.

        Returns after the shard is stored and the catalog committed. A trajectory
        already stored with the same content is acknowledged again (`created=False`)
        without a second copy; the same id with other content raises `Conflict`.
        Raises `Backpressure` when the write buffer stays full.
        """
        spec = self.spec(check_namespace(namespace))
        if not writes:
            return []
        seen: set[str] = set()
        for write in writes:
            if write.trajectory_id in seen:
                raise InvalidInput(
                    f"trajectory id {write.trajectory_id!r} appears twice in one put"
                )
            seen.add(write.trajectory_id)
        rows = [self.prepare(spec, write) for write in writes]
        stored = self.catalog.lookup(namespace, seen)
        clash = [
            r.trajectory_id
            for r in rows
            if r.trajectory_id in stored and stored[r.trajectory_id].digest != r.digest
        ]
        if clash:
            raise Conflict(f"trajectory ids already stored with other content: {clash[:10]}")
        fresh = [r for r in rows if r.trajectory_id not in stored]
        results = {
            r.trajectory_id: PutResult(r.trajectory_id, False)
            for r in rows
            if r.trajectory_id in stored
        }
        if fresh:
            for result in self._writer.submit(namespace, spec, fresh).result():
                results[result.trajectory_id] = result
        return [results[r.trajectory_id] for r in rows]

    def flush(self) -> None:
        """Commit pending writes now instead of waiting for the commit interval."""
        self._writer.flush()

    # reads

    def get_batch(self, namespace: str, ids: Sequence[str], decode: bool = True) -> Batch:
        """Routes of `ids`, in the order asked; missing ids are named in `Batch.missing`.

        With `decode=False` each item carries its stored streams (`encoded`) instead of
        decoded `Routes`, for callers that forward them (the HTTP server).
        """
        spec = self.spec(check_namespace(namespace))
        for tid in ids:
            check_id(tid)
        entries = self.catalog.lookup(namespace, ids)
        found = self._reader.read(entries.values(), spec, decode=decode)
        items: list[TrajectoryRead | None] = [found.get(tid) for tid in ids]
        missing = list(
            dict.fromkeys(tid for tid, item in zip(ids, items, strict=True) if item is None)
        )
        return Batch(list(ids), items, missing)

    def get(self, namespace: str, trajectory_id: str) -> Routes:
        """One trajectory's routes; `NotFound` if it is not stored."""
        item = self.get_batch(namespace, [trajectory_id]).items[0]
        if item is None or item.routes is None:
            raise NotFound(f"no trajectory {trajectory_id!r} in namespace {namespace!r}")
        return item.routes
