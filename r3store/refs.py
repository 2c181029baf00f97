"""Route refs: what a rollout puts in its training batch instead of the routes.

A `RouteRef` names stored routes by content: the namespace, the trajectory, the
segments (start and length each, contiguous, in token order), the source, the oldest
policy version, and one digest over the named segments' content digests. It is a few
hundred bytes as JSON (`to_json`), picklable, hashable, and equal to another exactly
when it names the same content. `resolve` checks every field of a ref against the read
it answers (the segments, their digest, the source and the policy version; the
namespace and the trajectory are what is read): a ref whose segments are gone, cut
differently, or stored with other content or at another version (the trajectory
rewritten, deleted by retention, or a tampered ref) raises `RefMismatch` naming the
ref; it never answers other routes or another ref's metadata.

    refs = [result.ref for result in client.put("run1", writes)]
    spec, batch = client.resolve(refs[rank::world])   # the rank's own, checked
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r3store.errors import InvalidInput, RefMismatch
from r3store.policy import ENGINE, Source
from r3store.records import (
    Batch,
    PutResult,
    SegmentRead,
    TrajectoryRead,
    assemble,
    check_id,
    check_namespace,
    check_source,
)

MAX_REF_SEGMENTS = 4096  # turns of one trajectory a ref may name
_HEX = frozenset("0123456789abcdef")


def combined_digest(digests: Sequence[bytes]) -> str:
    """The digest a ref holds: SHA-256[:16] over its segments' content digests in token
    order, as 32 hex digits. For a single segment, that segment's digest itself."""
    if len(digests) == 1:
        return digests[0].hex()
    return hashlib.sha256(b"".join(digests)).digest()[:16].hex()


@dataclass(frozen=True)
class RouteRef:
    namespace: str
    trajectory_id: str
    segments: tuple[tuple[int, int], ...]  # (start, num_tokens) per stored segment
    digest: str  # `combined_digest` of the segments' content digests
    policy_version: int  # the oldest of its segments'
    source: Source = ENGINE

    def __post_init__(self) -> None:
        check_namespace(self.namespace)
        check_id(self.trajectory_id)
        check_source(self.source)
        segments = self.segments
        if not isinstance(segments, tuple) or not 1 <= len(segments) <= MAX_REF_SEGMENTS:
            raise InvalidInput(
                f"{self}: a ref names 1 to {MAX_REF_SEGMENTS} segments as a tuple of "
                "(start, num_tokens)"
            )
        end = segments[0][0] if segments and len(segments[0]) == 2 else None
        for segment in segments:
            if (
                not isinstance(segment, tuple)
                or len(segment) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in segment)
                or segment[0] != end
                or segment[1] < 1
            ):
                raise InvalidInput(
                    f"{self}: segments must be contiguous (start, num_tokens) pairs in token "
                    f"order, got {list(segments)[:4]}"
                )
            end = segment[0] + segment[1]
        if segments[0][0] < 0:
            raise InvalidInput(f"{self}: a segment cannot start before token 0")
        if not isinstance(self.digest, str) or len(self.digest) != 32 or set(self.digest) - _HEX:
            raise InvalidInput(f"{self}: the digest must be 32 lower-case hex digits")
        version = self.policy_version
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise InvalidInput(f"{self}: policy_version must be an integer >= 0")

    def __str__(self) -> str:
        return f"ref {self.namespace}/{self.trajectory_id}"

    @property
    def start(self) -> int:
        return self.segments[0][0]

    @property
    def end(self) -> int:
        return self.segments[-1][0] + self.segments[-1][1]

    @property
    def num_tokens(self) -> int:
        return self.end - self.start

    @classmethod
    def of(cls, namespace: str, result: PutResult) -> RouteRef:
        """The ref of one acknowledged segment."""
        return cls(
            namespace,
            result.trajectory_id,
            ((result.start, result.num_tokens),),
            result.digest.hex(),
            result.policy_version,
            result.source,
        )

    @classmethod
    def joined(cls, refs: Sequence[RouteRef]) -> RouteRef:
        """One ref for consecutive refs of one trajectory and source (the turns of a
        multi-turn rollout, each acknowledged on its own)."""
        if not refs:
            raise InvalidInput("no refs to join")
        first = refs[0]
        for ref in refs[1:]:
            if (ref.namespace, ref.trajectory_id, ref.source) != (
                first.namespace,
                first.trajectory_id,
                first.source,
            ):
                raise InvalidInput(f"{ref} is of another trajectory or source than {first}")
        segments = tuple(s for ref in refs for s in ref.segments)
        digests = [bytes.fromhex(ref.digest) for ref in refs]
        if any(len(ref.segments) > 1 for ref in refs):
            raise InvalidInput("join refs of single segments (as puts return them)")
        return cls(
            first.namespace,
            first.trajectory_id,
            segments,
            combined_digest(digests),
            min(ref.policy_version for ref in refs),
            first.source,
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "trajectory_id": self.trajectory_id,
            "segments": [list(s) for s in self.segments],
            "digest": self.digest,
            "policy_version": self.policy_version,
            "source": self.source,
        }

    @classmethod
    def from_dict(cls, data: Any) -> RouteRef:
        """A ref from `to_dict`'s form (checked as untrusted input)."""
        keys = {"namespace", "trajectory_id", "segments", "digest", "policy_version", "source"}
        if not isinstance(data, dict) or set(data) - keys or "segments" not in data:
            raise InvalidInput(f"not a route ref: {str(data)[:120]!r}")
        segments = data["segments"]
        if not isinstance(segments, list) or not all(isinstance(s, list) for s in segments):
            raise InvalidInput("a ref's segments are a list of [start, num_tokens]")
        try:
            return cls(
                data["namespace"],
                data["trajectory_id"],
                tuple(tuple(s) for s in segments),
                data["digest"],
                data["policy_version"],
                data.get("source", ENGINE),
            )
        except KeyError as exc:
            raise InvalidInput(f"a route ref needs {exc.args[0]!r}") from None

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> RouteRef:
        try:
            return cls.from_dict(json.loads(text))
        except (ValueError, TypeError) as exc:
            raise InvalidInput(f"not a route ref: {exc}") from None


def by_source(refs: Sequence[RouteRef]) -> tuple[str, dict[Source, list[str]]]:
    """The one namespace `refs` name (one spec for the tensors they make) and the ids
    to read of each route source, once each, in order."""
    if not refs:
        raise InvalidInput("no refs to resolve")
    namespace = refs[0].namespace if isinstance(refs[0], RouteRef) else None
    wanted: dict[Source, dict[str, None]] = {}
    for ref in refs:
        if not isinstance(ref, RouteRef):
            raise InvalidInput(f"not a route ref: {type(ref).__name__}")
        if ref.namespace != namespace:
            raise InvalidInput(f"refs resolved together name one namespace: {ref} and {refs[0]}")
        wanted.setdefault(ref.source, {})[ref.trajectory_id] = None
    return ref.namespace, {source: list(ids) for source, ids in wanted.items()}


def resolve(refs: Sequence[RouteRef], reads: dict[Source, Batch]) -> Batch:
    """The trajectories `refs` name, in their order, from `reads` (a read per source of
    their ids, carrying each segment's stored digest): each only the segments its ref
    names.

    Raises `RefMismatch` naming the first ref whose trajectory is missing or stale, whose
    segments are not stored as named, or whose content digest differs."""
    found = {
        (source, item.trajectory_id): item
        for source, batch in reads.items()
        for item in batch.found
    }
    stale = {(source, tid) for source, batch in reads.items() for tid in batch.stale}
    items: list[TrajectoryRead | None] = []
    for ref in refs:
        read = found.get((ref.source, ref.trajectory_id))
        if read is None:
            why = (
                "is older than the namespace's staleness window (resolve with include_stale)"
                if (ref.source, ref.trajectory_id) in stale
                else "is no longer stored (deleted by retention, or never stored here)"
            )
            raise RefMismatch(f"{ref}: the trajectory {why}")
        items.append(_named(ref, read))
    layers = {batch.layers for batch in reads.values()}
    return Batch(
        [ref.trajectory_id for ref in refs], items, [], [], layers.pop() if layers else None
    )


def _named(ref: RouteRef, read: TrajectoryRead) -> TrajectoryRead:
    if read.source != ref.source:
        raise RefMismatch(f"{ref}: no {ref.source} routes are stored for it")
    by_start = {s.start: s for s in read.segments}
    named: list[SegmentRead] = []
    for start, num_tokens in ref.segments:
        segment = by_start.get(start)
        if segment is None or segment.num_tokens != num_tokens:
            raise RefMismatch(
                f"{ref}: tokens [{start}, {start + num_tokens}) are no longer stored as one "
                "segment (the trajectory was rewritten)"
            )
        if not segment.digest:
            raise RefMismatch(f"{ref}: the read carries no content digests to check")
        named.append(segment)
    digest = combined_digest([s.digest for s in named])
    if digest != ref.digest:
        raise RefMismatch(
            f"{ref}: the stored routes have digest {digest}, the ref names {ref.digest} "
            "(rewritten since, or the ref was altered)"
        )
    stored = min(s.policy_version for s in named)
    if stored != ref.policy_version:
        raise RefMismatch(
            f"{ref}: its segments were stored at policy version {stored}, the ref names "
            f"{ref.policy_version} (the ref was altered)"
        )
    if any(s.encoded is None for s in named):
        raise RefMismatch(f"{ref}: resolve reads stored streams (decode=False)")
    if ref.start:  # a later turn alone: its tokens from 0, as a trainer sees them
        named = [dataclasses.replace(s, start=s.start - ref.start) for s in named]
    prompt_len = max(0, read.prompt_len - ref.start)
    return assemble(named, (read.trajectory_id, read.group_id, prompt_len), source=ref.source)
