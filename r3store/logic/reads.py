"""One trajectory's read from its segments' stored streams: decoded, or handed out as
streams that decode alone. Every read assembles here: the engine's batch reads and
the client's direct reads (`r3store.protocol.plans.reads_of`). Pure."""

from __future__ import annotations

from collections.abc import Sequence

from r3store.logic import codec
from r3store.policy import Source
from r3store.records import SegmentRead, TrajectoryRead, assemble
from r3store.route_types import Dictionaries, Dictionary, EncodedRoutes
from r3store.spec import RouteSpec


def read_of(
    segments: Sequence[tuple[int, int, int]],
    encoded: Sequence[EncodedRoutes],
    identity: tuple[str, str | None, int],
    source: Source,
    spec: RouteSpec,
    dictionaries: Dictionaries,
    decode: bool,
    portable: bool = False,
    as_stored: bool = False,
) -> TrajectoryRead:
    """One trajectory from its segments' `(start, num_tokens, policy_version)` and
    stored streams: decoded, or as streams when `decode` is False. Streams handed out
    decode alone: those that need a dictionary or a shared prefix are encoded again
    (`codec.portable`) when `portable`, else the trajectory is decoded. `as_stored`:
    the streams as they are (for a caller that decodes them once itself, with
    `dictionaries`)."""

    def dictionary(digest: bytes | None) -> Dictionary | None:
        return None if digest is None else dictionaries.get(digest)

    if not decode and as_stored:
        reads = [SegmentRead(*seg, s, s.digest) for seg, s in zip(segments, encoded, strict=True)]
        return assemble(reads, identity, source=source)

    if not decode and portable:
        encoded = [
            codec.portable(s, spec, seg[1], dictionary(s.dictionary))
            for seg, s in zip(segments, encoded, strict=True)
        ]
    if not decode and all(codec.self_contained(s) for s in encoded):
        reads = [SegmentRead(*seg, s, s.digest) for seg, s in zip(segments, encoded, strict=True)]
        return assemble(reads, identity, source=source)

    return assemble(
        [SegmentRead(*seg, None, s.digest) for seg, s in zip(segments, encoded, strict=True)],
        identity,
        [
            codec.decode(s, spec, seg[1], dictionary(s.dictionary))
            for seg, s in zip(segments, encoded, strict=True)
        ],
        [
            None if s.tokens is None else codec.decode_tokens(s.tokens, seg[1])
            for seg, s in zip(segments, encoded, strict=True)
        ],
        source,
    )
