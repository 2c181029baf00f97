"""Read plans: where a batch's route streams lie in the object store, with URLs that
read them, so a trainer fetches the bytes itself and the server only looks them up.

The server makes a plan from catalog entries (`make_plan`); the client fetches each
object's ranges with the object's presigned URL and a `Range` header, then slices every
segment's streams out of them (`Fetched`, `reads_of`). Pure: URLs come from a callable.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from r3store.catalog_types import TrajectoryEntry
from r3store.logic.codec import Dictionaries, EncodedRoutes
from r3store.logic.reads import read_of
from r3store.logic.spans import ByteRange, RouteSpans, Span
from r3store.policy import ENGINE, Source
from r3store.records import Batch, TrajectoryRead, missing
from r3store.spec import RouteSpec


@dataclass(frozen=True)
class PlannedObject:
    """One shard: a URL that reads it until the plan expires, and the byte ranges that
    hold the plan's streams (neighbours coalesced)."""

    key: str
    url: str
    ranges: list[ByteRange]


@dataclass(frozen=True)
class PlannedSegment:
    trajectory_id: str
    group_id: str | None
    prompt_len: int
    start: int
    num_tokens: int
    policy_version: int
    digest: bytes
    obj: int  # index into `ReadPlan.objects`
    spans: RouteSpans
    source: Source = ENGINE


@dataclass(frozen=True)
class PlannedDictionary:
    """A zstd dictionary some planned streams need: its digest, and a URL that reads it."""

    digest: bytes
    url: str


@dataclass(frozen=True)
class ReadPlan:
    """What a batch read would return, as places to fetch: `ids` in the order asked,
    `missing` and `stale` as a batch read names them, segments in token order."""

    spec: RouteSpec
    ids: list[str]
    missing: list[str]
    stale: list[str]
    expires_at: float
    objects: list[PlannedObject]
    segments: list[PlannedSegment]
    dictionaries: list[PlannedDictionary] = field(default_factory=list)


def make_plan(
    spec: RouteSpec,
    ids: list[str],
    found: dict[str, list[TrajectoryEntry]],
    stale: list[str],
    presign: Callable[[str], str],
    dictionary_key: Callable[[bytes], str],
    cover: Callable[[Iterable[Span]], list[ByteRange]],
    expires_at: float,
) -> ReadPlan:
    """The plan of the catalog entries `found` (per trajectory, in token order)."""
    by_key: dict[str, list[TrajectoryEntry]] = {}
    for entries in found.values():
        for entry in entries:
            by_key.setdefault(entry.shard_key, []).append(entry)
    index = {key: i for i, key in enumerate(by_key)}
    objects = [
        PlannedObject(key, presign(key), cover(s for e in held for s in e.spans.spans))
        for key, held in by_key.items()
    ]
    segments = [
        PlannedSegment(
            e.trajectory_id,
            e.group_id,
            e.prompt_len,
            e.start,
            e.num_tokens,
            e.policy_version,
            e.digest,
            index[e.shard_key],
            e.spans,
            e.source,
        )
        for tid in dict.fromkeys(ids)
        for e in found.get(tid, [])
    ]
    digests = sorted({d for s in segments if (d := s.spans.dictionary) is not None})
    return ReadPlan(
        spec,
        list(ids),
        missing(ids, found, stale),
        stale,
        expires_at,
        objects,
        segments,
        [PlannedDictionary(d, presign(dictionary_key(d))) for d in digests],
    )


class Fetched:
    """Bytes fetched from one object, by range; slices out any span they cover."""

    def __init__(self) -> None:
        self._parts: list[tuple[ByteRange, bytes]] = []

    def add(self, byte_range: ByteRange, data: bytes) -> None:
        self._parts.append((byte_range, data))

    def slice(self, span: Span) -> bytes:
        for byte_range, data in self._parts:
            if byte_range.start <= span.offset and span.end <= byte_range.end:
                start = span.offset - byte_range.start
                return data[start : start + span.length]
        raise KeyError(span)


def reads_of(plan: ReadPlan, fetched: list[Fetched], dictionaries: Dictionaries) -> Batch:
    """The batch a read answers, its segments carrying their stored streams (decode
    them with `codec.decode`, or `tensors.compact`), or decoded when stored with a
    dictionary (from `dictionaries`) or a shared prefix; `fetched[i]` holds object i's."""
    by_id: dict[str, list[tuple[PlannedSegment, EncodedRoutes]]] = {}
    for seg in plan.segments:
        streams = seg.spans.streams(fetched[seg.obj].slice, seg.digest)
        by_id.setdefault(seg.trajectory_id, []).append((seg, streams))
    reads: dict[str, TrajectoryRead] = {}
    for tid, parts in by_id.items():
        first = parts[0][0]
        reads[tid] = read_of(
            [(s.start, s.num_tokens, s.policy_version) for s, _ in parts],
            [streams for _, streams in parts],
            (tid, first.group_id, first.prompt_len),
            first.source,
            plan.spec,
            dictionaries,
            decode=False,
        )
    return Batch(plan.ids, [reads.get(t) for t in plan.ids], plan.missing, plan.stale)
