"""Where stored bytes lie: value types shared by the shard format, the catalog, the
object stores, read plans and the client (no I/O, no pyarrow)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from r3store.logic.codec import EncodedRoutes, Transform


@dataclass(frozen=True)
class ByteRange:
    """Bytes `[start, end)` of an object: `ByteRange(0, 1024)` is the first KiB."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if self.start < 0 or self.end <= self.start:
            raise ValueError(f"empty or negative byte range [{self.start}, {self.end})")

    @property
    def length(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class Span:
    """`length` bytes at `offset` in a shard: one stored value."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


@dataclass(frozen=True)
class RouteSpans:
    """Where one trajectory's route streams lie in its shard: its own, and those of the
    prefix it shares (`prefix`, the first `prefix_tokens` tokens; a row of the same
    shard). `dictionary`: the digest of the zstd dictionary its ids streams need."""

    ids: Span
    counts: Span | None
    order: Span | None
    transform: int
    tokens: Span | None = None
    dictionary: bytes | None = None
    prefix: RouteSpans | None = None
    prefix_tokens: int = 0
    prefix_digest: bytes = b""  # the prefix row's (content digest of its routes)

    @property
    def spans(self) -> list[Span]:
        own = [s for s in (self.ids, self.counts, self.order, self.tokens) if s is not None]
        return own + ([] if self.prefix is None else self.prefix.spans)

    def streams(self, read: Callable[[Span], bytes], digest: bytes) -> EncodedRoutes:
        """The stored streams, given a way to read the bytes of a span."""

        def optional(span: Span | None) -> bytes | None:
            return None if span is None else read(span)

        return EncodedRoutes(
            read(self.ids),
            optional(self.counts),
            optional(self.order),
            Transform(self.transform),
            digest,
            optional(self.tokens),
            self.dictionary,
            None if self.prefix is None else self.prefix.streams(read, self.prefix_digest),
            self.prefix_tokens,
        )
