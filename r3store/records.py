"""What callers hand the engine and what it hands back."""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from r3store.errors import Conflict, InvalidInput
from r3store.policy import ENGINE, MAX_POLICY_VERSION, SOURCES, Source
from r3store.route_types import Dictionaries, EncodedRoutes, Routes, SentStreams

_NAMESPACE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_REFUSED = {"Cc", "Cs"}  # control characters, surrogates
MAX_ID_LENGTH = 256
MAX_TOKENS = 2**31 - 1  # of one segment
MAX_START = 2**62  # where an appended segment begins
_RANGES = (
    ("num_tokens", 1, MAX_TOKENS),
    ("prompt_len", 0, MAX_TOKENS),
    ("policy_version", 0, MAX_POLICY_VERSION),
    ("start", 0, MAX_START),
)


SlotOrder = Literal["rank", "verbatim", "set"]
SLOT_ORDERS: tuple[SlotOrder, ...] = ("rank", "verbatim", "set")
RANK: SlotOrder = "rank"  # best first, as the producer ranked its experts
VERBATIM: SlotOrder = "verbatim"  # the engine's slots as given: no rank order, kept on purpose
SET: SlotOrder = "set"  # no order promised: the slots are a set


def check_namespace(name: str) -> str:
    """Namespaces: 1-128 letters, digits, `.`, `_`, `-`, starting with a letter or digit."""
    if not isinstance(name, str) or not _NAMESPACE.fullmatch(name):
        raise InvalidInput(
            f"invalid namespace {name!r}: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit"
        )
    return name


def check_source(value: object) -> Source:
    """A route source: one of `policy.SOURCES`."""
    for source in SOURCES:
        if value == source and isinstance(value, str):
            return source
    raise InvalidInput(f"unknown route source {value!r}: use one of {', '.join(SOURCES)}")


def check_id(value: str, what: str = "trajectory id") -> str:
    """Ids: 1-256 characters; no control characters (C0, DEL, C1) and no lone
    surrogates (text that is not Unicode)."""
    if (
        not isinstance(value, str)
        or not 1 <= len(value) <= MAX_ID_LENGTH
        or any(unicodedata.category(c) in _REFUSED for c in value)
    ):
        raise InvalidInput(f"invalid {what} {value!r}: use 1-{MAX_ID_LENGTH} printable characters")
    return value


@dataclass(frozen=True)
class TrajectoryWrite:
    """One trajectory to store: routes as top-k ids, as bit-packed masks, or as the
    streams `codec.encode` makes (`encoded`, checked by decoding: `r3store.logic.streams`);
    exactly one of them.

    `TrajectoryWrite("run1/p7/s3", num_tokens=4096, topk=ids, prompt_len=512,
    group_id="run1/p7", policy_version=12)`; see `r3store.logic.routes` for the array forms,
    and `r3store.logic.writes` for its routes validated (`canonical_routes`) and encoded
    where they are (`encode_write`).

    Multi-turn: `start > 0` appends a segment of `num_tokens` tokens beginning at token
    `start`, which must be where the trajectory now ends; each segment has its own
    policy version. `group_id` and `prompt_len` belong to the first segment; an
    appended one leaves them unset or repeats them.

    `source` says whose routes these are (`policy.Source`). `engine` routes make the
    trajectory; another source annotates a stored engine segment of the same start and
    length, whose group, prompt length and policy version it takes.

    `slot_order` says what the order of each token-layer's K slots is: `"rank"` (the
    default: best first, as the producer ranked them; for plain ids it is the caller's
    word), `"verbatim"` (the engine's slots as its kernel left them, no rank order, to be
    kept as given: a tensor given back bit for bit) or `"set"` (no order promised, as
    vLLM's and SGLang's captured routes). An `ordered` namespace refuses `"set"`
    (`logic.writes.check_slot_order`), naming `producer`, what made the routes (the
    converters set both). Neither is sent or stored: the check is made where the
    write is made (docs/replay.md, "Slot order").
    """

    trajectory_id: str
    num_tokens: int
    topk: Any = None
    mask: Any = None
    prompt_len: int = 0
    group_id: str | None = None
    policy_version: int = 0
    start: int = 0
    token_ids: Any = None
    encoded: SentStreams | None = None
    source: Source = ENGINE
    slot_order: SlotOrder = RANK
    producer: str = ""

    def tokens(self) -> npt.NDArray[np.int32] | None:
        """The token ids as `[num_tokens]` int32, checked; None when not given."""
        if self.token_ids is None:
            return None
        arr = np.asarray(self.token_ids)
        if arr.dtype.kind not in "iu" or arr.shape != (self.num_tokens,):
            raise InvalidInput(
                f"{self.trajectory_id}: token_ids must be {self.num_tokens} integers, "
                f"got {arr.dtype} {list(arr.shape)}"
            )
        if arr.size and (int(arr.min()) < 0 or int(arr.max()) > 2**31 - 1):
            raise InvalidInput(f"{self.trajectory_id}: token ids must be in [0, 2**31)")
        return arr.astype(np.int32)

    def check(self) -> None:
        check_id(self.trajectory_id)
        check_source(self.source)
        if self.slot_order not in SLOT_ORDERS or not isinstance(self.producer, str):
            raise InvalidInput(
                f"{self.trajectory_id}: slot_order must be one of {', '.join(SLOT_ORDERS)} "
                f"and producer a string, got {self.slot_order!r}, {self.producer!r}"
            )
        if self.group_id is not None:
            check_id(self.group_id, "group id")
        for name, low, high in _RANGES:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise InvalidInput(
                    f"{self.trajectory_id}: {name} must be an integer in [{low}, {high}], "
                    f"got {value!r}"
                )
        if self.prompt_len > self.start + self.num_tokens:
            raise InvalidInput(
                f"{self.trajectory_id}: prompt_len {self.prompt_len} "
                f"exceeds the {self.start + self.num_tokens} tokens"
            )
        given = [x is not None for x in (self.topk, self.mask, self.encoded)]
        if sum(given) != 1:
            raise InvalidInput(f"{self.trajectory_id}: give exactly one of topk, mask or encoded")


# what describes a segment besides its routes, under the same names in each of its
# records (a write, a direct commit's segment, a shard row, a catalog entry)
SEGMENT_FIELDS = (
    "trajectory_id",
    "start",
    "group_id",
    "policy_version",
    "num_tokens",
    "prompt_len",
    "source",
)


def segment_fields(record: Any) -> dict[str, Any]:
    """`record`'s `SEGMENT_FIELDS`, as keywords for another record of the same segment:
    `ShardRow(**segment_fields(write), routes=encoded)`."""
    return {name: getattr(record, name) for name in SEGMENT_FIELDS}


@dataclass(frozen=True)
class Segment:
    """What the store knows of one stored segment, for settling a new one."""

    start: int
    num_tokens: int
    digest: bytes
    group_id: str | None
    prompt_len: int
    policy_version: int = 0
    writer: str | None = None  # the key that uploaded it, when known


class Held:
    """One trajectory's segments of one source, stored and settled so far, indexed so
    that settling a segment against them costs the same however many there are."""

    def __init__(self, stored: Sequence[Segment]) -> None:
        self.digests: dict[int, bytes] = {}
        for segment in stored:
            self.digests.setdefault(segment.start, segment.digest)
        last = stored[-1] if stored else None
        self.end = 0 if last is None else last.start + last.num_tokens  # in start order

    def add(self, segment: Segment) -> None:
        self.digests.setdefault(segment.start, segment.digest)
        self.end = segment.start + segment.num_tokens


def settle(write_id: str, start: int, digest: bytes, stored: Sequence[Segment] | Held) -> bool:
    """Decide a segment against the trajectory's stored ones (in start order, or `Held`).

    True: new, store it. False: the same segment is stored already (a retry). Raises
    `Conflict` for the same start with other content, `InvalidInput` for an append
    that does not begin where the trajectory ends.
    """
    held = stored if isinstance(stored, Held) else Held(stored)
    found = held.digests.get(start)
    if found is not None:
        if found == digest:
            return False
        raise Conflict(f"{write_id} (from token {start}) is already stored with other content")
    if start != held.end:
        raise InvalidInput(
            f"{write_id}: a segment must start where the trajectory ends (token {held.end}), "
            f"not at token {start}"
        )
    return True


@dataclass(frozen=True)
class PutResult:
    """One acknowledged segment: `created` False when it was already stored with the
    same content. `ref`, on the client, names it (`r3store.refs.RouteRef`)."""

    trajectory_id: str
    created: bool  # False: it was already stored with the same content
    start: int = 0
    source: Source = ENGINE
    num_tokens: int = 0
    policy_version: int = 0
    digest: bytes = b""  # the segment's content digest (`codec.content_digest`)
    ref: Any = None  # a `RouteRef`, filled in by the client


@dataclass(frozen=True)
class SegmentRead:
    """One stored segment: its tokens, policy version and (when asked) stored streams."""

    start: int
    num_tokens: int
    policy_version: int
    encoded: EncodedRoutes | None = None
    digest: bytes = b""  # the stored content digest, when the read carries it


@dataclass(frozen=True)
class TrajectoryRead:
    """One stored trajectory: metadata, its segments, and its routes decoded (all
    segments joined) unless stored streams were asked for."""

    trajectory_id: str
    group_id: str | None
    policy_version: int  # the oldest of its segments'
    num_tokens: int  # all segments together
    prompt_len: int
    segments: list[SegmentRead]
    routes: Routes | None = None
    token_ids: npt.NDArray[np.int32] | None = None  # -1 where a segment came without them
    source: Source = ENGINE  # whose routes these are


@dataclass(frozen=True)
class Batch:
    """A batch read: `items[i]` answers `ids[i]` (None where missing or stale);
    `missing` and `stale` name those ids. A read of some `layers` holds those only, in
    that order."""

    ids: list[str]
    items: list[TrajectoryRead | None]
    missing: list[str]
    stale: list[str]
    layers: tuple[int, ...] | None = None  # the spec's layers the routes hold; None: all
    # streams read as stored (`Engine.get_batch(as_stored=True)`): the dictionaries they
    # need, by digest
    dictionaries: Dictionaries = field(default_factory=dict)

    @property
    def found(self) -> list[TrajectoryRead]:
        return [item for item in self.items if item is not None]

    @property
    def lengths(self) -> list[int | None]:
        return [None if item is None else item.num_tokens for item in self.items]


def missing(ids: Sequence[str], found: Container[str], stale: Container[str]) -> list[str]:
    """The asked ids a read names missing: neither found nor stale, once each, in the
    order asked."""
    return [tid for tid in dict.fromkeys(ids) if tid not in found and tid not in stale]


def assemble(
    segments: Sequence[SegmentRead],
    identity: tuple[str, str | None, int],
    routes: Sequence[Routes] | None = None,
    tokens: Sequence[npt.NDArray[np.int32] | None] | None = None,
    source: Source = ENGINE,
) -> TrajectoryRead:
    """One trajectory from its segments in token order: `identity` is its id, group and
    prompt length; `routes` and `tokens` are each segment's, when decoded. Token ids
    are -1 where a segment came without them (None when none had any)."""
    trajectory_id, group_id, prompt_len = identity
    joined = None
    if tokens is not None and any(t is not None for t in tokens):
        joined = np.concatenate(
            [
                np.full(s.num_tokens, -1, np.int32) if t is None else t.astype(np.int32)
                for s, t in zip(segments, tokens, strict=True)
            ]
        )
    return TrajectoryRead(
        trajectory_id=trajectory_id,
        group_id=group_id,
        policy_version=min(s.policy_version for s in segments),
        num_tokens=sum(s.num_tokens for s in segments),
        prompt_len=prompt_len,
        segments=list(segments),
        routes=None if routes is None else Routes.concat(list(routes)),
        token_ids=joined,
        source=source,
    )
