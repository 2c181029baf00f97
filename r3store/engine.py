"""The engine: validated, durable, group-committed writes and batched reads.

    engine = Engine(LocalStore("data/objects"), Catalog("sqlite:///data/catalog.db"))
    engine.create_namespace("run1", RouteSpec(num_layers=48, num_experts=128, top_k=8))
    engine.put("run1", [TrajectoryWrite("t0", num_tokens=4096, topk=ids)])
    batch = engine.get_batch("run1", ["t0", "t1"])   # batch.missing == ["t1"]

`put` returns only once the shard is stored and the catalog committed. It is safe to
call from many threads at once; the engine packs concurrent calls into shared shards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import random
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from r3store import codec
from r3store.catalog import Catalog, NamespaceInfo
from r3store.errors import Conflict, InvalidInput, NotFound, ObjectExists, StalePolicy
from r3store.policy import NamespaceSettings, is_stale, staleness_floor
from r3store.reader import ReaderConfig, ShardReader
from r3store.records import (
    Batch,
    PutResult,
    Segment,
    TrajectoryRead,
    TrajectoryWrite,
    check_id,
    check_namespace,
)
from r3store.routes import Routes, from_mask, from_topk
from r3store.sampling import Candidate, Strategy, choose
from r3store.shard import ShardRow
from r3store.spec import RouteSpec
from r3store.store.base import ObjectStore
from r3store.writer import GroupCommitter, WriterConfig, WriterStats, as_segment, settle_rows

NAMESPACE_PREFIX = "namespaces/"
TOMBSTONE_PREFIX = "tombstones/"


@dataclass(frozen=True)
class EngineConfig:
    writer: WriterConfig = field(default_factory=WriterConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    compression_level: int = codec.DEFAULT_LEVEL


def namespace_key(name: str) -> str:
    return f"{NAMESPACE_PREFIX}{name}.json"


def _salt(write: TrajectoryWrite) -> bytes:
    """The metadata that is part of a segment's content digest."""
    group = (write.group_id or "").encode()
    head = struct.pack(
        "<qqqqB",
        write.start,
        write.num_tokens,
        write.prompt_len,
        write.policy_version,
        write.group_id is None,
    )
    return head + hashlib.sha256(group).digest()


def manifest(info: NamespaceInfo) -> bytes:
    """The namespace's record in the object store (what a catalog rebuild reads)."""
    return json.dumps(
        {
            "name": info.name,
            "spec": json.loads(info.spec.to_json()),
            "settings": info.settings.model_dump(mode="json"),
            "policy_version": info.policy_version,
            "created_at": info.created_at,
        }
    ).encode()


class Engine:
    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` stamps commits (retention's time to live reads it); tests inject one."""
        self.store = store
        self.catalog = catalog
        self.config = config or EngineConfig()
        self.clock = clock
        self._reader = ShardReader(store, self.config.reader)
        self._writer = GroupCommitter(
            store, catalog, self.config.writer, on_shard=self._reader.remember, clock=clock
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
    def writer_stats(self) -> WriterStats:
        return self._writer.stats

    # namespaces

    def create_namespace(
        self, name: str, spec: RouteSpec, settings: NamespaceSettings | None = None
    ) -> NamespaceInfo:
        """Create a namespace (one RL run) with its fixed route spec.

        The manifest goes to the object store first (create-only), so a catalog rebuild
        finds namespaces that hold no shards yet. The same call again is a no-op;
        another spec under the same name is a `Conflict`.
        """
        check_namespace(name)
        settings = settings or NamespaceSettings()
        info = NamespaceInfo(name, spec, self.clock(), 0, settings)
        try:
            self.store.put_if_absent(namespace_key(name), manifest(info))
        except ObjectExists:
            stored = json.loads(self.store.get(namespace_key(name)))
            if RouteSpec(**stored["spec"]) != spec:
                raise Conflict(f"namespace {name!r} exists with another route spec") from None
            info = dataclasses.replace(info, created_at=float(stored["created_at"]))
        return self.catalog.create_namespace(name, spec, settings, info.created_at)

    def namespace(self, name: str) -> NamespaceInfo:
        return self.catalog.namespace(check_namespace(name))

    def list_namespaces(self) -> list[NamespaceInfo]:
        return self.catalog.list_namespaces()

    def update_settings(self, name: str, settings: NamespaceSettings) -> NamespaceInfo:
        info = self.catalog.update_settings(check_namespace(name), settings)
        self.store.put(namespace_key(name), manifest(info))
        return info

    def set_policy_version(self, name: str, version: int) -> NamespaceInfo:
        """The trainer's current policy version; it only moves forward."""
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"policy version must be a non-negative integer, got {version!r}")
        info = self.catalog.set_policy_version(check_namespace(name), version)
        self.store.put(namespace_key(name), manifest(info))
        return info

    def delete_namespace(self, name: str) -> int:
        """Delete a namespace, its trajectories and its objects; returns objects deleted.

        The catalog forgets everything first; objects go only after that.
        """
        keys = self.catalog.delete_namespace(check_namespace(name))
        with self._lock:
            self._specs.pop(name, None)
        tombstones = [info.key for info in self.store.list(f"{TOMBSTONE_PREFIX}{name}/")]
        for key in [*keys, *tombstones]:
            self.store.delete(key)
        self.store.delete(namespace_key(name))
        return len(keys) + len(tombstones) + 1

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
        """Validate and encode one segment (pure CPU work, done in the caller's thread)."""
        routes = self.prepare_routes(spec, write)
        encoded = codec.encode(
            routes,
            spec,
            self.config.compression_level,
            salt=_salt(write),
            token_ids=write.tokens(),
        )
        return ShardRow(
            trajectory_id=write.trajectory_id,
            start=write.start,
            group_id=write.group_id,
            policy_version=write.policy_version,
            num_tokens=write.num_tokens,
            prompt_len=write.prompt_len,
            digest=encoded.digest,
            routes=encoded,
        )

    def put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> list[PutResult]:
        """Store trajectories (or appended segments) durably; all of them or, on any
        error, none.

        Returns after the shard is stored and the catalog committed. A segment already
        stored with the same content is acknowledged again (`created=False`) without a
        second copy; the same id and start with other content raises `Conflict`; routes
        older than the staleness window raise `StalePolicy`; a full write buffer raises
        `Backpressure`.
        """
        info = self.namespace(namespace)
        if not writes:
            return []
        seen: set[tuple[str, int]] = set()
        for write in writes:
            write.check()
            key = (write.trajectory_id, write.start)
            if key in seen:
                raise InvalidInput(
                    f"trajectory {write.trajectory_id!r} from token {write.start} "
                    "appears twice in one put"
                )
            seen.add(key)
            if is_stale(write.policy_version, info.policy_version, info.settings):
                raise StalePolicy(
                    f"{write.trajectory_id}: policy version {write.policy_version} is older "
                    f"than the window (current {info.policy_version}, "
                    f"max lag {info.settings.max_policy_lag})"
                )
        known = self.catalog.lookup(namespace, {w.trajectory_id for w in writes})
        stored = {tid: [as_segment(e) for e in segments] for tid, segments in known.items()}
        writes = [self._inherit(w, stored, writes) for w in writes]
        rows = [self.prepare(info.spec, write) for write in writes]
        fresh, results = settle_rows(rows, stored)  # refuse now what the commit would
        if fresh:
            for result in self._writer.submit(namespace, info.spec, fresh).result():
                results[(result.trajectory_id, result.start)] = result
        return [results[(r.trajectory_id, r.start)] for r in rows]

    @staticmethod
    def _inherit(
        write: TrajectoryWrite, stored: dict[str, list[Segment]], batch: Sequence[TrajectoryWrite]
    ) -> TrajectoryWrite:
        """An appended segment takes its trajectory's group and prompt length."""
        if write.start == 0:
            return write
        first = next(
            (s for s in stored.get(write.trajectory_id, []) if s.start == 0), None
        ) or next(
            (w for w in batch if w.trajectory_id == write.trajectory_id and w.start == 0), None
        )
        if first is None:
            raise InvalidInput(
                f"{write.trajectory_id}: cannot append from token {write.start} "
                "to a trajectory that is not stored"
            )
        if write.group_id is not None and write.group_id != first.group_id:
            raise InvalidInput(f"{write.trajectory_id}: an appended segment changes the group id")
        if write.prompt_len not in (0, first.prompt_len):
            raise InvalidInput(f"{write.trajectory_id}: an appended segment changes prompt_len")
        return dataclasses.replace(write, group_id=first.group_id, prompt_len=first.prompt_len)

    def flush(self) -> None:
        """Commit pending writes now instead of waiting for the commit interval."""
        self._writer.flush()

    # reads

    def get_batch(
        self,
        namespace: str,
        ids: Sequence[str],
        decode: bool = True,
        include_stale: bool = False,
    ) -> Batch:
        """Routes of `ids`, in the order asked.

        Missing ids are named in `Batch.missing`; trajectories with a segment older than
        the staleness window are named in `Batch.stale` instead of being served, unless
        `include_stale`. With `decode=False` each item carries its segments' stored
        streams instead of decoded `Routes`, for callers that forward them.
        """
        info = self.namespace(namespace)
        for tid in ids:
            check_id(tid)
        found = self.catalog.lookup(namespace, ids)
        stale = []
        if not include_stale:
            floor = staleness_floor(info.policy_version, info.settings)
            if floor is not None:
                for tid, segments in list(found.items()):
                    if min(s.policy_version for s in segments) < floor:
                        stale.append(tid)
                        del found[tid]
        reads = self._reader.read(found, info.spec, decode=decode)
        items: list[TrajectoryRead | None] = [reads.get(tid) for tid in ids]
        missing = [tid for tid in dict.fromkeys(ids) if tid not in reads and tid not in stale]
        return Batch(list(ids), items, missing, stale)

    def get(self, namespace: str, trajectory_id: str) -> Routes:
        """One trajectory's routes; `NotFound` if it is not stored (or stale)."""
        item = self.get_batch(namespace, [trajectory_id]).items[0]
        if item is None or item.routes is None:
            raise NotFound(f"no trajectory {trajectory_id!r} in namespace {namespace!r}")
        return item.routes

    def sample(
        self,
        namespace: str,
        n: int,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        decode: bool = True,
        seed: int | None = None,
    ) -> Batch:
        """Take up to `n` trajectories for training, within the staleness window.

        FIFO takes the oldest first, UNIFORM uniformly at random; `whole_groups` never
        splits a prompt group. Each taken trajectory counts one sampling; once it has
        been sampled `max_times_sampled` times it is no longer offered.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidInput(f"n must be a positive integer, got {n!r}")
        info = self.namespace(namespace)
        limit = info.settings.max_times_sampled
        floor = staleness_floor(info.policy_version, info.settings)
        rows = self.catalog.sampling_candidates(namespace, floor, limit)
        candidates = [Candidate(tid, group, created) for tid, group, created in rows]
        chosen = choose(candidates, n, strategy, whole_groups, random.Random(seed))
        taken = self.catalog.mark_sampled(namespace, chosen, limit)
        found = self.catalog.lookup(namespace, taken)
        reads = self._reader.read(found, info.spec, decode=decode)
        return Batch(taken, [reads.get(tid) for tid in taken], [], [])
