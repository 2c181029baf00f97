"""Read plans: where a batch's route streams lie in the object store, with URLs that
read them, so a trainer fetches the bytes itself and the server only looks them up.

The server makes a plan from catalog entries (`make_plan`); the client fetches each
object's ranges with the object's presigned URL and a `Range` header, then slices every
segment's streams out of them (`Fetched`, `reads_of`). Pure: URLs come from a callable.

The dataclasses here are also the plan's JSON (docs/api.md, "Direct reads"): their
fields carry their JSON forms (`fields.py`), so pydantic reads and writes them as they
are (`models.ReadPlanModel`); a segment's JSON is made from its fields, `obj` named
`object` and its `RouteSpans` as flat fields (`PlannedSegment.json_model`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, get_type_hints

from pydantic import BaseModel, Field, GetCoreSchemaHandler, create_model
from pydantic_core import CoreSchema, core_schema

from r3store.catalog_types import TrajectoryEntry
from r3store.errors import InvalidInput
from r3store.logic.reads import read_of
from r3store.policy import ENGINE, Source
from r3store.protocol.fields import Hex, Range, SpansJson, Spec
from r3store.records import Batch, TrajectoryRead, missing
from r3store.route_types import Dictionaries, EncodedRoutes
from r3store.spans import ByteRange, RouteSpans, Span
from r3store.spec import RouteSpec


@dataclass(frozen=True)
class PlannedObject:
    """One shard: a URL that reads it until the plan expires, and the byte ranges that
    hold the plan's streams (neighbours coalesced)."""

    key: str
    url: Annotated[str, Field(description="a presigned GET; send `Range: bytes=start-(end-1)`")]
    ranges: Annotated[list[Range], Field(description="[start, end) byte ranges to fetch")]


@dataclass(frozen=True)
class PlannedSegment:
    trajectory_id: str
    group_id: str | None
    prompt_len: int
    start: int
    num_tokens: int
    policy_version: int
    digest: Annotated[Hex, Field(description="hex")]
    obj: Annotated[int, Field(ge=0, description="index into objects")]  # `ReadPlan.objects`
    spans: RouteSpans
    source: Source = ENGINE

    @classmethod
    def json_model(cls) -> type[BaseModel]:
        """The segment's JSON as a model made from its fields: `obj` as `object`, the
        `spans` as `SpansJson`'s fields in its place; fields with defaults (a server
        before them sent none) after the others, the segment's own first."""
        if _SEGMENT_JSON:
            return _SEGMENT_JSON[0]
        hints = get_type_hints(cls, include_extras=True)
        head: dict[str, Any] = {}
        own: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name == "spans":
                head.update(_SPANS_REQUIRED)
            elif f.default is dataclasses.MISSING:
                head[_JSON_NAMES.get(f.name, f.name)] = (hints[f.name], ...)
            else:
                own[_JSON_NAMES.get(f.name, f.name)] = (hints[f.name], f.default)
        fields = {**head, **own, **_SPANS_DEFAULTED}
        _SEGMENT_JSON.append(create_model(cls.__name__, **fields))
        return _SEGMENT_JSON[0]

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[Any], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        schema = handler(cls.json_model())
        return core_schema.no_info_after_validator_function(
            _segment_of,
            schema,
            serialization=core_schema.plain_serializer_function_ser_schema(
                _json_of, return_schema=schema
            ),
        )


@dataclass(frozen=True)
class PlannedDictionary:
    """A zstd dictionary some planned streams need: its digest, and a URL that reads it."""

    digest: Annotated[Hex, Field(description="hex, SHA-256[:16] of the dictionary's bytes")]
    url: Annotated[str, Field(description="a presigned GET of the whole dictionary")]


_JSON_NAMES = {"obj": "object"}  # a segment's fields named otherwise in its JSON
_SPANS_REQUIRED = {
    n: (f.annotation, f) for n, f in SpansJson.model_fields.items() if f.is_required()
}
_SPANS_DEFAULTED = {
    n: (f.annotation, f) for n, f in SpansJson.model_fields.items() if not f.is_required()
}
_SEGMENT_JSON: list[type[BaseModel]] = []  # made once, on first use


def _json_of(segment: PlannedSegment) -> BaseModel:
    """A segment as its JSON model (values already of their fields' types)."""
    spans = SpansJson.model_validate(segment.spans.to_json())
    own = {
        _JSON_NAMES.get(f.name, f.name): getattr(segment, f.name)
        for f in dataclasses.fields(segment)
        if f.name != "spans"
    }
    return PlannedSegment.json_model().model_construct(**own, **dict(spans))


def _segment_of(data: BaseModel) -> PlannedSegment:
    """A segment from its JSON model (validated)."""
    try:
        spans = RouteSpans.from_json(data.model_dump(include=set(SpansJson.model_fields)))
    except ValueError:
        text = getattr(data, "route_dictionary", None) or ""
        raise InvalidInput(f"not a hex digest: {text[:40]!r}") from None
    own = {
        f.name: getattr(data, _JSON_NAMES.get(f.name, f.name))
        for f in dataclasses.fields(PlannedSegment)
        if f.name != "spans"
    }
    return PlannedSegment(**own, spans=spans)


@dataclass(frozen=True)
class ReadPlan:
    """What a batch read would return, as places to fetch: `ids` in the order asked,
    `missing` and `stale` as a batch read names them, segments in token order."""

    spec: Spec
    ids: list[str]
    missing: list[str]
    stale: list[str]
    expires_at: Annotated[float, Field(description="seconds since the epoch")]
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
