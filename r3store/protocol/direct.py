"""Direct writes, as they cross the wire: a rollout worker asks for a write plan, asks
for the plan's create-only URL for its blob's size, puts its segments' encoded streams
in one object with it, and commits by naming where each segment's streams lie in it
(docs/api.md, "Direct writes"). No I/O.

The object (a blob) is the streams one after another, nothing else: what it holds is
said by the commit. `pack` makes a blob and its segments from encoded writes (the
client); `unpack` makes writes again from a blob and a commit nobody has checked (the
server), each span inside the blob and the decoded size bounded before anything is
decompressed; the streams themselves are checked by `r3store.logic.streams.accept`.
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field

from r3store.errors import InvalidInput
from r3store.logic import codec
from r3store.logic.streams import MAX_UPLOAD_BYTES, decoded_bytes
from r3store.policy import ENGINE, MAX_POLICY_VERSION, Source
from r3store.protocol.fields import SpanModel
from r3store.protocol.models import PutItem
from r3store.records import MAX_ID_LENGTH, TrajectoryWrite, segment_fields
from r3store.route_types import SentStreams
from r3store.spans import RouteSpans, Span
from r3store.spec import RouteSpec

MAX_SEGMENTS = 4096  # segments one commit names (its JSON stays under 4 MiB)
MAX_BLOB_BYTES = 256 << 20  # one blob, as uploaded
PLAN_SECONDS = 600  # a plan's URL works this long by default
MAX_PLAN_SECONDS = 3600
MAX_NEXT_PLANS = 16  # plans one commit may answer


class WritePlanRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    expires: int = Field(
        PLAN_SECONDS, ge=10, le=MAX_PLAN_SECONDS, description="seconds the URL works"
    )


class PlanDictionary(BaseModel):
    """The namespace's newest zstd dictionary: compress ids streams with it."""

    digest: str = Field(description="hex: SHA-256[:16] of its bytes (check them against it)")
    url: str = Field(description="a presigned GET of it (it never changes)")


class WritePlanModel(BaseModel):
    """One blob's plan: encode with `dictionary` when given, ask for the blob's URL
    (`.../writes/upload`) before `expires_at`, PUT the blob there, then commit it
    naming `plan`."""

    plan: str = Field(description="the plan's signed token: send it back with the commit")
    expires_at: float = Field(description="when the plan expires (Unix seconds)")
    max_bytes: int = Field(description="the largest blob a commit accepts")
    dictionary: PlanDictionary | None = Field(
        None, description="the namespace's dictionary (made by compression at rest), or none"
    )


class UploadRequest(BaseModel):
    """The URL of a plan's blob, once it is encoded: `size` bytes."""

    model_config = ConfigDict(extra="forbid", strict=True)

    plan: str = Field(min_length=1, max_length=2048)
    size: int = Field(ge=1, le=MAX_BLOB_BYTES)


class BlobUploadModel(BaseModel):
    """PUT the blob, exactly `size` bytes, to `url` with `headers` before `expires_at`."""

    url: str = Field(description="a presigned, create-only PUT of exactly the blob's size")
    headers: dict[str, str] = Field(description="headers the PUT must carry (signed)")
    expires_at: float = Field(description="when the URL stops working (Unix seconds)")


class DirectSegment(BaseModel):
    """One segment of a direct write: its metadata, and where its streams lie in the
    blob (`{offset, length}`). `token_ids` is a zstd frame of its `[T]` int32 LE ids."""

    model_config = ConfigDict(extra="forbid", strict=True)

    trajectory_id: str = Field(min_length=1, max_length=MAX_ID_LENGTH)
    num_tokens: int = Field(ge=1, le=2**31 - 1)
    start: int = Field(0, ge=0, le=2**31 - 1)
    prompt_len: int = Field(0, ge=0, le=2**31 - 1)
    policy_version: int = Field(0, ge=0, le=MAX_POLICY_VERSION)
    group_id: str | None = Field(None, min_length=1, max_length=MAX_ID_LENGTH)
    source: Source = ENGINE
    route_transform: int = Field(ge=0, le=255)
    route_ids: SpanModel
    route_counts: SpanModel | None = None
    route_order: SpanModel | None = None
    token_ids: SpanModel | None = None
    route_dictionary: str | None = Field(
        None, pattern="^[0-9a-f]{32}$", description="hex digest of the ids stream's dictionary"
    )

    @property
    def dictionary(self) -> bytes | None:
        """The digest of the dictionary its ids stream was compressed with, if any."""
        return None if self.route_dictionary is None else bytes.fromhex(self.route_dictionary)

    def spans(self) -> RouteSpans:
        """Where its streams lie (as a catalog row records them)."""

        def span(model: SpanModel | None) -> Span | None:
            return None if model is None else model.to_span()

        return RouteSpans(
            self.route_ids.to_span(),
            span(self.route_counts),
            span(self.route_order),
            self.route_transform,
            span(self.token_ids),
            self.dictionary,
        )


class WriteCommit(BaseModel):
    """A blob uploaded with a plan, committed: `size` bytes, holding `segments`."""

    model_config = ConfigDict(extra="forbid", strict=True)

    plan: str = Field(min_length=1, max_length=2048)
    size: int = Field(ge=1, le=MAX_BLOB_BYTES)
    segments: list[DirectSegment] = Field(min_length=1, max_length=MAX_SEGMENTS)
    next_plans: int = Field(
        0, ge=0, le=MAX_NEXT_PLANS, description="answer this many plans for the next blobs"
    )


class WriteCommitted(BaseModel):
    """A commit's answer: a result per segment, as an upload's, and the plans for the
    next blobs asked for (saving their requests)."""

    results: list[PutItem]
    next: list[WritePlanModel] = Field(default_factory=list)


def pack(writes: Sequence[TrajectoryWrite]) -> tuple[bytes, list[DirectSegment]]:
    """The blob and the commit's segments of encoded writes (`TrajectoryWrite.encode`);
    their token ids go as `tokens` streams."""
    parts: list[bytes] = []
    segments: list[DirectSegment] = []
    at = 0

    def place(data: bytes | None) -> SpanModel | None:
        nonlocal at
        if data is None:
            return None
        parts.append(data)
        at += len(data)
        return SpanModel(offset=at - len(data), length=len(data))

    for w in writes:
        sent = w.encoded
        if sent is None:
            raise InvalidInput(f"{w.trajectory_id}: a direct write needs encoded routes")
        tokens = sent.tokens if sent.tokens is not None else codec.compress_tokens(w.tokens())
        ids = place(sent.ids)
        assert ids is not None
        segments.append(
            DirectSegment(
                **segment_fields(w),
                route_transform=int(sent.transform),
                route_ids=ids,
                route_counts=place(sent.counts),
                route_order=place(sent.order),
                token_ids=place(tokens),
                route_dictionary=None if sent.dictionary is None else sent.dictionary.hex(),
            )
        )
    return b"".join(parts), segments


STREAMS = {
    "route_ids": "ids",
    "route_counts": "counts",
    "route_order": "order",
    "token_ids": "tokens",
}


def unpack(
    blob: bytes | memoryview, segments: Sequence[DirectSegment], spec: RouteSpec
) -> list[TrajectoryWrite]:
    """The writes a commit names in `blob` (streams copied out of it), to be checked like
    an upload's encoded rows. `InvalidInput` for a span outside the blob, streams that
    do not lie end to end over the whole blob (as `pack` lays them: no byte named twice,
    none named by no stream), or more routes than one upload may decode."""
    view = memoryview(blob)
    # what checking them decompresses (ids and token ids), bounded before any of it
    total = sum(decoded_bytes(spec, s.num_tokens) + 4 * s.num_tokens for s in segments)
    named = [
        (s.trajectory_id, name, m)
        for s in segments
        for field, name in STREAMS.items()
        if (m := getattr(s, field)) is not None
    ]
    for tid, name, m in named:
        if m.offset + m.length > len(view):
            raise InvalidInput(
                f"{tid}: its {name} stream [{m.offset}, {m.offset + m.length}) lies past "
                f"the end of the {len(view)}-byte blob"
            )
    spans = sorted((m.offset, m.length) for _tid, _name, m in named)
    end = 0
    for offset, length in spans:
        if offset != end:
            why = "streams overlap (a byte named twice)" if offset < end else "a gap"
            raise InvalidInput(
                f"the segments' streams do not lie end to end over the {len(view)}-byte "
                f"blob: {why} at byte {min(offset, end)}"
            )
        end = offset + length
    if end != len(view):
        raise InvalidInput(
            f"the segments' streams span {end} bytes of a {len(view)}-byte blob: every "
            "byte of a blob belongs to one stream"
        )
    if total > MAX_UPLOAD_BYTES:
        raise InvalidInput(
            f"the commit's routes decode to {total} bytes; at most {MAX_UPLOAD_BYTES} in one "
            "commit: write fewer at a time"
        )

    def cut(model: SpanModel | None) -> bytes | None:
        return None if model is None else bytes(view[model.offset : model.offset + model.length])

    writes = []
    for s in segments:
        ids = cut(s.route_ids)
        assert ids is not None
        sent = SentStreams(
            ids,
            s.route_transform,
            cut(s.route_counts),
            cut(s.route_order),
            cut(s.token_ids),
            s.dictionary,
        )
        writes.append(TrajectoryWrite(**segment_fields(s), encoded=sent))
    return writes
