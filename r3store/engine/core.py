"""The engine: validated, durable, group-committed writes and batched reads.

    engine = Engine(LocalStore("data/objects"), Catalog("sqlite:///data/catalog.db"))
    engine.namespaces.create("run1", RouteSpec(num_layers=48, num_experts=128, top_k=8))
    engine.put("run1", [TrajectoryWrite("t0", num_tokens=4096, topk=ids)])
    batch = engine.get_batch("run1", ["t0", "t1"])   # batch.missing == ["t1"]

`put` returns only once the shard is stored and the catalog committed. It is safe to
call from many threads at once; the engine packs concurrent calls into shared shards.

`Engine` itself holds the data path (put and commit, flush; get_batch, get, sample,
read_plan) and what is asked of the engine as a whole (ping, close, writer_stats,
store_description). The rest is in its parts, each a module of its own: `encoder`
(`Encoder`, in `encoding`: the write half of a put, checked, encoded and settled
before its commit, which `direct` uses too), `namespaces` (`Namespaces`: create, get,
all, settings, policy version, delete, spec, count, usage), `consumption`
(`Consumption`: leases, step checkpoints, resume), `keys` (`ApiKeys`), `direct`
(`DirectWrites`: write plans and their commits), `analytics` (`Analytics`) and
`upkeep` (`Upkeep`: maintenance passes, binding the store to the catalog, rebuilding
the catalog).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from r3store.catalog_types import NamespaceInfo, TrajectoryEntry
from r3store.engine.analytics import Analytics
from r3store.engine.api_keys import ApiKeys
from r3store.engine.consumption import Consumption, admitting
from r3store.engine.direct import DirectWrites
from r3store.engine.encoding import EncodedPut, Encoder
from r3store.engine.namespaces import Namespaces
from r3store.engine.reader import ReaderConfig, ShardReader, plan_ranges
from r3store.engine.upkeep import Upkeep
from r3store.engine.writer import (
    GroupCommitter,
    WriterConfig,
    WriterStats,
)
from r3store.errors import (
    CorruptShard,
    InvalidInput,
    NotFound,
    ObjectNotFound,
    StoreError,
)
from r3store.logic import codec
from r3store.logic.sampling import Strategy
from r3store.logic.sources import choose_source
from r3store.policy import (
    Source,
    staleness_floor,
)
from r3store.protocol.plans import ReadPlan, make_plan
from r3store.records import (
    Batch,
    PutResult,
    TrajectoryRead,
    TrajectoryWrite,
    check_id,
    check_source,
    missing,
)
from r3store.route_types import Routes
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.keys import dictionary_key
from r3store.storage.store.base import ObjectStore


@dataclass(frozen=True)
class EngineConfig:
    writer: WriterConfig = field(default_factory=WriterConfig)
    reader: ReaderConfig = field(default_factory=ReaderConfig)
    compression_level: int = codec.DEFAULT_LEVEL
    # how far ahead of its namespace's current policy version a write may be; None: any
    max_policy_ahead: int | None = None


class Engine:
    def __init__(
        self,
        store: ObjectStore,
        catalog: Catalog,
        config: EngineConfig | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` stamps commits (retention's time to live reads it); tests inject one."""
        self._store = store
        self._catalog = catalog
        self.config = config or EngineConfig()
        self.clock = clock
        self._reader = ShardReader(store, self.config.reader)
        self._writer = GroupCommitter(
            store, catalog, self.config.writer, on_shard=self._reader.remember, clock=clock
        )
        self.namespaces = Namespaces(store, catalog, clock)
        self.keys = ApiKeys(catalog)
        self.consumption = Consumption(catalog, self.namespaces, clock)
        self.analytics = Analytics(catalog, self._reader, self.namespaces.spec)
        self.encoder = Encoder(
            catalog,
            self.namespaces,
            self._reader.dictionaries,
            self.config.compression_level,
            self.config.max_policy_ahead,
        )
        self.direct = DirectWrites(
            store, catalog, self.namespaces, self.encoder, self._writer, self.analytics, clock
        )
        self.upkeep = Upkeep(
            store, catalog, self.namespaces, self.analytics, self.config.writer.row_group_bytes
        )

    def close(self) -> None:
        """Commit what is pending, then stop the threads and release connections."""
        self._writer.flush()
        self._writer.close()
        self._reader.close()
        self._catalog.close()
        self._store.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def writer_stats(self) -> WriterStats:
        return self._writer.stats

    # operations: what the server and the CLI need of the store and the catalog

    @property
    def store_description(self) -> str:
        return self._store.description

    def ping(self) -> None:
        """`StoreError` unless both the object store and the catalog answer."""
        self._store.ping()
        self._catalog.ping()

    # writes

    prepare_routes = staticmethod(Encoder.prepare_routes)

    def encode(
        self,
        namespace: str,
        writes: Sequence[TrajectoryWrite],
        stop: Callable[[], bool] | None = None,
        writer: str | None = None,
        annotate_any: bool = True,
    ) -> EncodedPut:
        """The first half of `put` (`Encoder.encode`): check, validate and encode
        `writes`, refusing what the commit would."""
        return self.encoder.encode(namespace, writes, stop, writer, annotate_any)

    def put(
        self,
        namespace: str,
        writes: Sequence[TrajectoryWrite],
        writer: str | None = None,
        annotate_any: bool = True,
    ) -> list[PutResult]:
        """Store trajectories (or appended segments) durably; all of them or, on any
        error, none.

        Returns after the shard is stored and the catalog committed. A segment already
        stored with the same content is acknowledged again (`created=False`) without a
        second copy; the same id and start with other content raises `Conflict`; routes
        older than the staleness window raise `StalePolicy`; a full write buffer raises
        `Backpressure`. `writer` (an API key's name) is recorded with the new segments;
        without `annotate_any`, routes of another source may annotate only engine
        segments that `writer` wrote (`Forbidden` otherwise). The same as
        `commit(encode(namespace, writes, writer=writer, annotate_any=annotate_any))`.
        """
        return self.commit(self.encode(namespace, writes, writer=writer, annotate_any=annotate_any))

    def commit(self, put: EncodedPut) -> list[PutResult]:
        """The second half of `put`: store the fresh rows and wait for the commit."""
        committed: list[PutResult] = []
        if put.fresh:
            future = self._writer.submit(put.namespace, put.spec, put.fresh)
            try:
                committed = future.result(timeout=self.config.writer.commit_timeout)
            except TimeoutError:
                raise StoreError(
                    f"the commit did not finish within {self.config.writer.commit_timeout:g} s "
                    "(the object store or catalog is slow); it may still land: retry, "
                    "retries are idempotent"
                ) from None
            self.analytics.compare_sources(put.namespace, put.spec, put.fresh)
        return put.answer(committed)

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
        source: Source | None = None,
        admit: Callable[[list[TrajectoryEntry]], None] | None = None,
        as_stored: bool = False,
    ) -> Batch:
        """Routes of `ids`, in the order asked.

        Missing ids are named in `Batch.missing`; trajectories with a segment older than
        the staleness window are named in `Batch.stale` instead of being served, unless
        `include_stale`. With `decode=False` each item carries its segments' stored
        streams instead of decoded `Routes`, for callers that forward them: streams that
        decode alone, or with `as_stored` the streams as stored (a row at rest may need
        a dictionary, in `Batch.dictionaries`, or continue a shared prefix), for a
        caller that decodes each once itself (`protocol.answers.encode_batch`).

        Each trajectory is served from one route source: `source` when given (ids that
        hold no routes of it for all their tokens are missing), else the first of the
        namespace's `read_sources` it holds; `TrajectoryRead.source` says which.

        `admit(segments)` sees the segments found before any is read, and may refuse
        the read by raising (an answer too large, say).
        """
        info, current, stale = self._lookup(namespace, ids, include_stale, source, admit)
        reads = self._read(current, info.spec, decode, as_stored)
        items: list[TrajectoryRead | None] = [reads.get(tid) for tid in ids]
        batch = Batch(list(ids), items, missing(ids, reads, stale), stale)
        return self._with_dictionaries(namespace, batch) if as_stored else batch

    def read_plan(
        self,
        namespace: str,
        ids: Sequence[str],
        expires: int,
        include_stale: bool = False,
        source: Source | None = None,
    ) -> ReadPlan:
        """Where the routes of `ids` lie, with URLs that read them for `expires` seconds:
        a direct read, whose bytes the caller fetches from the object store itself.
        `InvalidInput` when the store hands out no URLs (the embedded store)."""
        info, current, stale = self._lookup(namespace, ids, include_stale, source)
        if not self._store.signs_urls:
            raise InvalidInput(
                f"direct reads need an object store that signs URLs (S3); "
                f"{self._store.description} does not: read through the server"
            )
        config = self._reader.config
        return make_plan(
            info.spec,
            list(ids),
            current(),
            stale,
            lambda key: self._store.presign_get(key, expires),
            lambda digest: dictionary_key(namespace, digest),
            lambda spans: plan_ranges(spans, config.coalesce_bytes, config.gap_bytes),
            time.time() + expires,
        )

    def _lookup(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool,
        source: Source | None,
        admit: Callable[[list[TrajectoryEntry]], None] | None = None,
    ) -> tuple[NamespaceInfo, Callable[[], dict[str, list[TrajectoryEntry]]], list[str]]:
        """The namespace, a lookup of `ids` (the segments of the source each is served
        from) that leaves out (and names in the list) trajectories older than the
        staleness window unless `include_stale`, and shows what it found to `admit`."""
        info = self.namespaces.get(namespace)
        for tid in ids:
            check_id(tid)
        wanted = info.settings.read_sources if source is None else [check_source(source)]
        floor = None if include_stale else staleness_floor(info.policy_version, info.settings)
        stale: list[str] = []

        def current() -> dict[str, list[TrajectoryEntry]]:
            found = self._served(namespace, ids, wanted)
            stale.clear()
            if floor is not None:
                for tid, segments in list(found.items()):
                    if min(s.policy_version for s in segments) < floor:
                        stale.append(tid)
                        del found[tid]
            if admit is not None:
                admit([s for segments in found.values() for s in segments])
            return found

        return info, current, stale

    def _served(
        self, namespace: str, ids: Sequence[str], wanted: Sequence[Source]
    ) -> dict[str, list[TrajectoryEntry]]:
        """The segments of the source each found id is served from."""
        served = {}
        for tid, segments in self._catalog.segments.lookup(namespace, ids).items():
            chosen = choose_source(segments, wanted)
            if chosen is not None:
                served[tid] = chosen[1]
        return served

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
        admit: Callable[[list[TrajectoryEntry]], None] | None = None,
        as_stored: bool = False,
        holder: str | None = None,
    ) -> Batch:
        """Take up to `n` trajectories for training, within the staleness window, and
        count them at once (a lease committed as it is taken: `consumption.lease` holds
        them until the trainer commits instead).

        FIFO takes the oldest first, UNIFORM uniformly at random; `whole_groups` never
        splits a prompt group. Each taken trajectory counts one sampling; once it has
        been sampled `max_times_sampled` times it is no longer offered. Trajectories an
        open lease holds are not offered. `admit` sees the chosen trajectories'
        segments before any is counted or read, and may refuse the sample by raising
        (nothing is counted then).
        """
        info = self.namespaces.get(namespace)
        wanted = info.settings.read_sources
        check = None if admit is None else admitting(wanted, admit)
        lease = self.consumption.lease(
            namespace,
            n=n,
            strategy=strategy,
            whole_groups=whole_groups,
            seed=seed,
            admit=check,
            holder=holder,
            commit=True,
        )
        taken = list(lease.trajectory_ids)
        reads = self._read(
            lambda: self._served(namespace, taken, wanted), info.spec, decode, as_stored
        )
        missed = [tid for tid in taken if tid not in reads]  # none of `read_sources` held
        batch = Batch(taken, [reads.get(tid) for tid in taken], missed, [])
        return self._with_dictionaries(namespace, batch) if as_stored else batch

    def _with_dictionaries(self, namespace: str, batch: Batch) -> Batch:
        """`batch` with the dictionaries its stored streams need (read and cached once
        per namespace and digest)."""
        digests = {
            s.encoded.dictionary
            for item in batch.found
            for s in item.segments
            if s.encoded is not None and s.encoded.dictionary is not None
        }
        if not digests:
            return batch
        return dataclasses.replace(
            batch, dictionaries=self._reader.dictionaries.many(namespace, digests)
        )

    def _read(
        self,
        lookup: Callable[[], dict[str, list[TrajectoryEntry]]],
        spec: RouteSpec,
        decode: bool,
        as_stored: bool = False,
    ) -> dict[str, TrajectoryRead]:
        """Read what `lookup` finds. A shard that vanished between the lookup and the
        read (compaction moved its rows, and its grace ran out) means the catalog has
        moved on: look up again, once."""
        try:
            return self._reader.read(lookup(), spec, decode=decode, as_stored=as_stored)
        except ObjectNotFound:
            pass
        try:
            return self._reader.read(lookup(), spec, decode=decode, as_stored=as_stored)
        except ObjectNotFound as exc:
            raise CorruptShard(f"the catalog names a shard that is missing: {exc}") from exc
