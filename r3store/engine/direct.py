"""Direct writes (`engine.direct`): a rollout worker uploads its encoded streams to the
object store itself, and the engine checks and commits them.

`plan` records the blob's key as a planned upload (so that an upload never committed
is an orphan collection deletes) and answers a signed token naming the namespace, the
key, the API key that asked and when the plan expires. `upload` takes the token back
once the blob is encoded and answers a presigned, create-only URL for exactly the
blob's size (no larger than a commit may take), working until the plan expires, so
that what a plan lets anyone store is bounded. `commit` takes the
token back, from that API key only, reads the blob the worker uploaded, checks every
segment's streams exactly as an upload's (`Engine.encode`: the namespace, staleness,
`streams.accept`), writes the blob's index (`storage/blob.py`) and commits the catalog
(`GroupCommitter.commit_stored`, which writes the index of exactly the rows it
commits, before it commits them). A commit sent again answers the same results
(`created=False` once committed); nothing the engine did not check is acknowledged,
cataloged or served. The store is trusted with what it holds: the URL is create-only,
so the bytes checked are the bytes readers get.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from r3store.engine.encoding import Encoder
from r3store.errors import (
    Backpressure,
    DirectUnavailable,
    Forbidden,
    InvalidInput,
    ObjectNotFound,
    PayloadTooLarge,
    PlanGone,
)
from r3store.logic import signing
from r3store.protocol.direct import MAX_BLOB_BYTES, DirectSegment, unpack
from r3store.records import PutResult, TrajectoryWrite
from r3store.spans import ByteRange, RouteSpans
from r3store.storage.blob import write_index
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.ledger import DIRECT
from r3store.storage.keys import blob_key, dictionary_key, is_blob
from r3store.storage.shard import ShardRow
from r3store.storage.store.base import ObjectStore

if TYPE_CHECKING:
    from r3store.engine.analytics import Analytics
    from r3store.engine.namespaces import Namespaces
    from r3store.engine.writer import GroupCommitter

SECRET = "write_plan_secret"  # the catalog value that signs plans
DICTIONARY_SECONDS = 30.0


@dataclass(frozen=True)
class WritePlan:
    plan: str
    expires_at: float
    max_bytes: int
    dictionary: tuple[bytes, str] | None = None  # the namespace's newest: digest, URL


@dataclass(frozen=True)
class BlobUpload:
    """Where a plan's blob goes: PUT exactly its size to `url` with `headers`."""

    url: str
    headers: dict[str, str]
    expires_at: float


@dataclass(eq=False)
class DirectWrites:
    store: ObjectStore
    catalog: Catalog
    namespaces: Namespaces
    encoder: Encoder
    committer: GroupCommitter
    analytics: Analytics
    clock: Callable[[], float] = time.time
    _secret: bytes | None = field(default=None, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)
    # per namespace, its newest dictionary and when it was looked up
    _newest: dict[str, tuple[bytes | None, float]] = field(default_factory=dict, init=False)

    @property
    def available(self) -> bool:
        """Whether the store hands out URLs (S3); the embedded store does not."""
        return self.store.signs_urls

    def _key(self) -> bytes:
        if self._secret is None:
            self._secret = self.catalog.ledger.secret(SECRET)
        return self._secret

    def _dictionary(self, namespace: str, now: float) -> bytes | None:
        """The namespace's newest dictionary, looked up at most every `DICTIONARY_SECONDS`
        (one a plan names and collection took since is refused at the commit, which
        the client answers with a new plan)."""
        with self._lock:
            known = self._newest.get(namespace)
        if known is not None and now - known[1] < DICTIONARY_SECONDS:
            return known[0]
        newest = self.catalog.ledger.newest_dictionary(namespace)
        if newest is not None:  # none yet: asked again, so a new one is used at once
            with self._lock:
                self._newest[namespace] = (newest, now)
        return newest

    def plan(
        self, namespace: str, writer: str | None, expires: int, most: int | None = None
    ) -> WritePlan:
        """A plan for one blob of `namespace`, for the API key named `writer`, who may
        hold `most` plans not committed and not expired (`Backpressure` past it)."""
        made = self.plans(namespace, writer, expires, 1, most)
        if not made:
            raise Backpressure(
                f"this API key holds {most} write plans not committed and not expired, the "
                "most it may (R3STORE_MAX_PLANS_PER_KEY): commit or let them expire first"
            )
        return made[0]

    def plans(
        self,
        namespace: str,
        writer: str | None,
        expires: int,
        count: int,
        most: int | None = None,
    ) -> list[WritePlan]:
        """`count` plans (each for one blob) at once, their uploads planned in one
        catalog transaction; fewer (none) when `writer` would hold more than `most`
        plans not committed and not expired."""
        if not self.available:
            raise DirectUnavailable(
                f"direct writes need an object store that signs URLs (S3); "
                f"{self.store.description} does not: upload through the server"
            )
        self.namespaces.get(namespace)
        now = self.clock()
        keys = [blob_key(namespace, now) for _ in range(count)]
        # planned as of when their URLs stop working: never orphans while they can be used
        keys = self.catalog.ledger.plan_uploads(
            keys, namespace, DIRECT, now + expires, writer, most, at=now
        )
        newest = self._dictionary(namespace, now)
        dictionary = None
        if newest is not None:
            where = self.store.presign_get(dictionary_key(namespace, newest), expires)
            dictionary = (newest, where)
        out = []
        for key in keys:
            fields = {"n": namespace, "k": key, "w": writer, "e": now + expires}
            token = signing.sign(self._key(), fields)
            out.append(WritePlan(token, now + expires, MAX_BLOB_BYTES, dictionary))
        return out

    def upload(
        self, namespace: str, plan: str, size: int, writer: str | None, most: int
    ) -> BlobUpload:
        """The presigned, create-only PUT of the blob `plan` names, for exactly `size`
        bytes (the store refuses any other length), working until the plan expires;
        `PayloadTooLarge` past `most` bytes, `PlanGone` once the plan expired or is no
        longer planned (an object put then would be one no collection knows)."""
        key, expires_at = self._verify(namespace, plan, writer)
        most = min(most, MAX_BLOB_BYTES)
        if size > most:
            raise PayloadTooLarge(
                f"a blob of {size} bytes; a commit takes at most {most}: "
                "upload fewer segments in it"
            )
        left = int(expires_at - self.clock())
        if left < 1:
            raise PlanGone("the write plan expired: ask for a new one")
        if not self.catalog.ledger.is_planned(key, DIRECT):  # nothing would collect it
            raise PlanGone(
                "the write plan is no longer planned (committed, collected, or its namespace "
                "deleted): ask for a new one"
            )
        url, headers = self.store.presign_put(key, left, size)
        return BlobUpload(url, headers, expires_at)

    def check_plan(self, namespace: str, plan: str, writer: str | None) -> str:
        """The blob key of a plan this catalog signed for `namespace` and the API key
        `writer` (`InvalidInput`, `Forbidden` otherwise): checked before anything else."""
        return self._verify(namespace, plan, writer)[0]

    def _verify(self, namespace: str, plan: str, writer: str | None) -> tuple[str, float]:
        """A plan's blob key and expiry, checked as `check_plan` says."""
        fields = signing.verify(self._key(), plan, "write plan")
        key, expires_at = fields.get("k"), fields.get("e")
        if fields.get("n") != namespace or not isinstance(key, str) or not is_blob(key):
            raise InvalidInput(f"the write plan is not one of namespace {namespace!r}")
        if fields.get("w") != writer:
            raise Forbidden("the write plan was made for another API key")
        if not isinstance(expires_at, int | float):
            raise PlanGone("the write plan names no expiry (made by an older server)")
        return key, float(expires_at)

    def commit(
        self,
        namespace: str,
        plan: str,
        size: int,
        segments: Sequence[DirectSegment],
        writer: str | None,
        annotate_any: bool = True,
    ) -> list[PutResult]:
        """Check and commit the blob `plan` named, `size` bytes holding `segments`; the
        same results as `Engine.put` of those segments. The caller holds the memory
        the blob takes while it is checked (the server: its upload budget)."""
        key = self.check_plan(namespace, plan, writer)
        if size > MAX_BLOB_BYTES:
            raise PayloadTooLarge(f"a blob of {size} bytes; at most {MAX_BLOB_BYTES}")
        try:  # a byte more than said: a larger object is refused without reading it all
            blob = self.store.get(key, ByteRange(0, size + 1))
        except ObjectNotFound:
            raise InvalidInput(
                "nothing was uploaded with this plan (or its object was collected): PUT the "
                "blob to the plan's URL first"
            ) from None
        if len(blob) != size:
            shown = f"more than {size}" if len(blob) > size else str(len(blob))
            raise InvalidInput(f"the uploaded blob holds {shown} bytes; the commit says {size}")
        spec = self.namespaces.spec(namespace)  # cached: bounds only; `encode` reads it
        writes: list[TrajectoryWrite] = unpack(blob, segments, spec)
        del blob
        put = self.encoder.encode(namespace, writes, writer=writer, annotate_any=annotate_any)
        del writes
        committed: list[PutResult] = []
        if put.fresh:
            sent = {(s.trajectory_id, s.source, s.start): s for s in segments}
            spans = [
                _stored_spans(sent[(r.trajectory_id, r.source, r.start)], r) for r in put.fresh
            ]

            def index(rows: list[ShardRow], at: list[RouteSpans]) -> str:
                now = self.clock()
                return write_index(self.store, key, namespace, put.spec, now, rows, at, now)

            try:
                committed = self.committer.commit_stored(
                    namespace, put.spec, key, size, put.fresh, spans, index
                )
            except PlanGone:
                with self._lock:  # its dictionary may be the one gone: look again
                    self._newest.pop(namespace, None)
                raise
            self.analytics.compare_sources(namespace, put.spec, put.fresh)
        return put.answer(committed)


def _stored_spans(segment: DirectSegment, row: ShardRow) -> RouteSpans:
    """The spans of what is stored of `segment`: counts that say every token-layer holds
    K are not stored (`streams.accept` drops them), so neither is their span."""
    spans = segment.spans()
    if row.routes.counts is None and spans.counts is not None:
        return dataclasses.replace(spans, counts=None)
    return spans
