"""The write half of a put, before any commit: writes checked (ids, sources, appends,
staleness, who may annotate what), their routes validated and encoded or a client's
encoded streams checked, and the rows settled against what is stored (new, a retry,
a conflict). `Encoder.encode` gives an `EncodedPut`; `Engine.commit` (a put through
the server) and `DirectWrites.commit` (a blob a worker uploaded) both store one.

    encoder = Encoder(catalog, namespaces, dictionaries, compression_level=3)
    put = encoder.encode("run1", writes, writer="rollout")   # refused now, or settled
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from r3store.engine.namespaces import Namespaces
from r3store.engine.settling import RowKey, known_segments, row_key, settle_rows
from r3store.errors import (
    CorruptShard,
    Forbidden,
    InvalidInput,
    ObjectNotFound,
    PlanGone,
    StalePolicy,
    StoreError,
)
from r3store.logic import codec, stats, streams
from r3store.logic.sources import engine_segments, inherit
from r3store.logic.writes import canonical_routes, check_slot_order
from r3store.policy import ENGINE, Source, is_stale, newest_accepted
from r3store.records import PutResult, Segment, TrajectoryWrite, segment_fields
from r3store.route_types import Dictionaries, Dictionary, Routes
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.dictionary import DictionaryCache
from r3store.storage.shard import ShardRow


@dataclass(frozen=True)
class EncodedPut:
    """A put validated and encoded, not yet committed (`Encoder.encode`)."""

    namespace: str
    spec: RouteSpec
    fresh: list[ShardRow]  # the rows to store
    results: dict[RowKey, PutResult]  # per (id, source, start); fresh ones until committed
    order: list[RowKey]  # the writes' order, for the answer

    def answer(self, committed: Sequence[PutResult] = ()) -> list[PutResult]:
        """A result per write, in their order: the `committed` results of the fresh rows
        (as their commit answered them), the settled ones for the others."""
        results = dict(self.results)
        for result in committed:
            results[(result.trajectory_id, result.source, result.start)] = result
        return [results[key] for key in self.order]


ROW_BYTES = 8 << 10  # what a row of a put holds besides its load counts (measured)


def put_row_bytes(spec: RouteSpec) -> int:
    """The memory one row of a put holds from its decoding to the commit, beyond its
    body and routes: its `[L, E]` int64 expert-load counts, and its records (the write,
    the shard row, the catalog entry, the result)."""
    return ROW_BYTES + 8 * spec.num_layers * spec.num_experts


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
    tail = b"" if write.source == ENGINE else write.source.encode()
    return head + hashlib.sha256(group).digest() + tail


def _annotating_own(
    writes: Sequence[TrajectoryWrite],
    stored: dict[tuple[str, Source], list[Segment]],
    writer: str | None,
) -> None:
    """`Forbidden` unless every write of another source annotates an engine segment
    that `writer` uploaded (stored by that key, or in the same put). A segment whose
    writer is unknown (stored before writers were recorded, or rebuilt) is nobody's."""
    writers = {
        (tid, s.start): s.writer
        for (tid, source), segments in stored.items()
        if source == ENGINE
        for s in segments
    }
    for write in writes:
        if write.source == ENGINE:
            continue
        key = (write.trajectory_id, write.start)
        if key in writers and (writer is None or writers[key] != writer):
            raise Forbidden(
                f"{write.trajectory_id} ({write.source} routes from token {write.start}): "
                "another key uploaded its engine routes; routes of another source annotate "
                "a trajectory only with the key that uploaded it, or one with the annotate "
                "right (admin)"
            )


@dataclass(eq=False)
class Encoder:
    """Checks, validates, encodes and settles writes of one catalog's namespaces.
    `compression_level`: the zstd level of routes encoded here; `max_ahead`: how far
    past its namespace's current policy version a write may be (None: any)."""

    catalog: Catalog
    namespaces: Namespaces
    dictionaries: DictionaryCache
    compression_level: int = codec.DEFAULT_LEVEL
    max_ahead: int | None = None

    @staticmethod
    def prepare_routes(spec: RouteSpec, write: TrajectoryWrite) -> Routes:
        """Validate one trajectory against `spec` and return its canonical routes."""
        write.check()
        return canonical_routes(write, spec)

    def prepare(
        self,
        spec: RouteSpec,
        write: TrajectoryWrite,
        writer: str | None = None,
        dictionary: Dictionary | None = None,
    ) -> ShardRow:
        """Validate and encode one checked segment, or check the streams a client
        encoded (pure CPU work, in the caller's thread; `dictionary`: the namespace's
        that they name); `writer`: the key uploading it."""
        check_slot_order(write, spec)
        if write.encoded is not None:
            where = write.trajectory_id
            encoded, load = streams.accept(
                write.encoded,
                spec,
                write.num_tokens,
                _salt(write),
                write.tokens(),
                where,
                dictionary,
            )
        else:
            routes = canonical_routes(write, spec)
            load = stats.expert_load(routes, spec)
            encoded = codec.encode(
                routes,
                spec,
                self.compression_level,
                salt=_salt(write),
                token_ids=write.tokens(),
            )
        return ShardRow(**segment_fields(write), routes=encoded, load=load, writer=writer)

    def encode(
        self,
        namespace: str,
        writes: Sequence[TrajectoryWrite],
        stop: Callable[[], bool] | None = None,
        writer: str | None = None,
        annotate_any: bool = True,
    ) -> EncodedPut:
        """The first half of `put`: check, validate and encode `writes` (and refuse
        what the commit would). The result no longer refers to the writes' arrays, so
        a caller can free them before the commit. `stop()` is asked before each write
        is encoded: once true (its request was answered), `StoreError` and no more
        work."""
        info = self.namespaces.get(namespace)
        seen: set[RowKey] = set()
        for write in writes:
            write.check()
            key = (write.trajectory_id, write.source, write.start)
            if key in seen:
                raise InvalidInput(
                    f"trajectory {write.trajectory_id!r} from token {write.start} "
                    f"({write.source} routes) appears twice in one put"
                )
            seen.add(key)
        known = (
            self.catalog.segments.lookup(namespace, {w.trajectory_id for w in writes})
            if writes
            else {}
        )
        stored = known_segments(known)
        engines = engine_segments(stored, writes)
        writes = [inherit(w, engines) for w in writes]
        if not annotate_any:
            _annotating_own(writes, stored, writer)
        newest = newest_accepted(info.policy_version, self.max_ahead)
        for write in writes:
            if is_stale(write.policy_version, info.policy_version, info.settings):
                raise StalePolicy(
                    f"{write.trajectory_id}: policy version {write.policy_version} is older "
                    f"than the window (current {info.policy_version}, "
                    f"max lag {info.settings.max_policy_lag})"
                )
            if newest is not None and write.policy_version > newest:
                raise InvalidInput(
                    f"{write.trajectory_id}: policy version {write.policy_version} is more "
                    f"than {self.max_ahead} ahead of the namespace's current "
                    f"version {info.policy_version} (the limit R3STORE_MAX_POLICY_AHEAD): "
                    "set the policy version first (PUT .../policy-version)"
                )
        dictionaries = self._named_dictionaries(namespace, writes)
        rows = []
        for write in writes:
            if stop is not None and stop():
                raise StoreError("the upload was answered before its routes were encoded")
            named = None if write.encoded is None else write.encoded.dictionary
            dictionary = None if named is None else dictionaries[named]
            rows.append(self.prepare(info.spec, write, writer, dictionary))
        fresh, results = settle_rows(rows, stored)  # refuse now what the commit would
        order = [row_key(r) for r in rows]
        return EncodedPut(namespace, info.spec, fresh, results, order)

    def _named_dictionaries(
        self, namespace: str, writes: Sequence[TrajectoryWrite]
    ) -> Dictionaries:
        """The namespace dictionaries that client-encoded writes name (a direct write's
        ids compressed with one); `PlanGone` for one the namespace does not have (any
        more: collected since the plan named it, or never its)."""
        named = [w.encoded.dictionary for w in writes if w.encoded is not None]
        try:
            return self.dictionaries.many(namespace, named)
        except (ObjectNotFound, CorruptShard):
            raise PlanGone(
                f"the writes name a dictionary that namespace {namespace!r} does not have "
                "(any more): encode them again with a new plan's dictionary"
            ) from None
