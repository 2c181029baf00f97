"""Where stored bytes lie: value types shared by the shard format, the catalog, the
object stores, read plans and the client (no I/O, no pyarrow)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from r3store.route_types import EncodedRoutes
from r3store.transforms import Transform


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


SPAN_NAMES = ("ids", "counts", "order", "tokens")  # a row's own streams
PREFIX_SPAN_NAMES = ("ids", "counts", "order")  # a shared prefix's streams
COLUMNS: tuple[str, ...] = (  # `RouteSpans.to_columns`, as the catalog stores them
    "transform",
    *(f"{name}_{part}" for name in SPAN_NAMES for part in ("offset", "length")),
    "dictionary",
    "prefix_tokens",
    "prefix_transform",
    "prefix_digest",
    *(f"prefix_{name}_{part}" for name in PREFIX_SPAN_NAMES for part in ("offset", "length")),
)
_JSON_NAMES = {"ids": "route_ids", "counts": "route_counts", "order": "route_order"}
_JSON_NAMES_ALL = {**_JSON_NAMES, "tokens": "token_ids"}


def _put(out: dict[str, Any], at: str, names: tuple[str, ...], spans: RouteSpans | None) -> None:
    for name in names:
        span: Span | None = None if spans is None else getattr(spans, name)
        out[f"{at}{name}_offset"] = None if span is None else span.offset
        out[f"{at}{name}_length"] = None if span is None else span.length


def _take(columns: Mapping[str, Any], at: str, names: tuple[str, ...]) -> dict[str, Span | None]:
    out: dict[str, Span | None] = {}
    for name in names:
        offset = columns.get(f"{at}{name}_offset")
        out[name] = None if offset is None else Span(offset, columns[f"{at}{name}_length"])
    return out


def _span_json(span: Span | None) -> dict[str, int] | None:
    return None if span is None else {"offset": span.offset, "length": span.length}


def _span_of(data: Mapping[str, Any] | None) -> Span | None:
    return None if data is None else Span(int(data["offset"]), int(data["length"]))


def _required_ids(spans: Mapping[str, Span | None], missing: str) -> Span:
    """The ids span of `spans`, which routes always have: ValueError(`missing`) without."""
    ids = spans["ids"]
    if ids is None:
        raise ValueError(missing)
    return ids


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

    def with_prefix(self, prefix: RouteSpans, tokens: int, digest: bytes) -> RouteSpans:
        """These spans continuing `prefix` (its first `tokens` tokens; `digest`: the
        prefix row's)."""
        return dataclasses.replace(self, prefix=prefix, prefix_tokens=tokens, prefix_digest=digest)

    # The one serialization: flat columns (`COLUMNS`; what the catalog stores: spans as
    # `<name>_offset`/`<name>_length`, the prefix's under `prefix_`, None where absent),
    # and the same fields as the read plan's JSON (`to_json`, docs/api.md).

    def to_columns(self) -> dict[str, Any]:
        """The flat columns of `COLUMNS`."""
        out: dict[str, Any] = {"transform": self.transform}
        _put(out, "", SPAN_NAMES, self)
        out["dictionary"] = self.dictionary
        out["prefix_tokens"] = self.prefix_tokens
        out["prefix_transform"] = None if self.prefix is None else self.prefix.transform
        out["prefix_digest"] = None if self.prefix is None else self.prefix_digest
        _put(out, "prefix_", PREFIX_SPAN_NAMES, self.prefix)
        return out

    @classmethod
    def from_columns(cls, columns: Mapping[str, Any]) -> RouteSpans:
        """The spans `to_columns` wrote (other keys are ignored); ValueError when the ids
        span, or a prefix's, is absent."""
        own = _take(columns, "", SPAN_NAMES)
        tokens = columns.get("prefix_tokens") or 0
        dictionary = columns.get("dictionary")
        ids = _required_ids(own, "no ids span")
        prefix = None
        if tokens:
            shared = _take(columns, "prefix_", PREFIX_SPAN_NAMES)
            prefix = cls(
                _required_ids(shared, "no prefix_ids span"),
                shared["counts"],
                shared["order"],
                columns["prefix_transform"],
                dictionary=dictionary,
            )
        return cls(
            ids,
            own["counts"],
            own["order"],
            columns["transform"],
            own["tokens"],
            dictionary,
            prefix,
            tokens,
            columns.get("prefix_digest") or b"",
        )

    def to_json(self) -> dict[str, Any]:
        """The read plan's fields of a segment's streams (docs/api.md, "Direct reads"):
        `route_transform`, `route_ids`/`route_counts`/`route_order`/`token_ids` as
        `{offset, length}` or None, `route_dictionary` (hex or None) and `prefix`
        (`tokens`, `route_transform` and its spans, or None)."""
        out: dict[str, Any] = {"route_transform": self.transform}
        out.update({key: _span_json(getattr(self, n)) for n, key in _JSON_NAMES_ALL.items()})
        out["route_dictionary"] = None if self.dictionary is None else self.dictionary.hex()
        shared = self.prefix
        out["prefix"] = (
            None
            if shared is None
            else {
                "tokens": self.prefix_tokens,
                "route_transform": shared.transform,
                **{key: _span_json(getattr(shared, n)) for n, key in _JSON_NAMES.items()},
            }
        )
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RouteSpans:
        """The spans of `to_json`'s fields (other keys are ignored); ValueError on a
        digest that is not hex, or when an ids span is absent."""
        text = data.get("route_dictionary")
        dictionary = None if text is None else bytes.fromhex(text)
        shared = data.get("prefix")

        def spans(of: Mapping[str, Any]) -> dict[str, Span | None]:
            return {n: _span_of(of.get(key)) for n, key in _JSON_NAMES.items()}

        own = spans(data)
        prefix = None
        if shared is not None:
            p = spans(shared)
            prefix = cls(
                _required_ids(p, "no prefix route_ids span"),
                p["counts"],
                p["order"],
                int(shared["route_transform"]),
                dictionary=dictionary,
            )
        return cls(
            _required_ids(own, "no route_ids span"),
            own["counts"],
            own["order"],
            int(data["route_transform"]),
            _span_of(data.get("token_ids")),
            dictionary,
            prefix,
            0 if shared is None else int(shared["tokens"]),
        )
