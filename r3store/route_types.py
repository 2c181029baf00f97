"""Routes as plain values: in memory in canonical form (`Routes`), as the stored
streams of a segment (`EncodedRoutes`), as the streams a client sends (`SentStreams`),
and the zstd dictionaries streams at rest may need (`Dictionary`). What makes and
checks them is the logic's (`r3store.logic.routes`, `codec`, `streams`). No I/O."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store.transforms import Transform

EMPTY = -1  # an empty slot in top-k ids


@dataclass(frozen=True, eq=False)
class Routes:
    """One trajectory's routes in canonical form: for each token-layer, the chosen
    experts first (sorted ascending for sets, in the producer's order when the spec
    keeps it; empty slots after the chosen ones), zeros in the empty slots, and a count
    of chosen slots (0: no recorded route). `r3store.logic.routes` makes them.

    `layers` is `[L, T, K]` of the spec's id dtype, layer-major as they are stored and
    as a trainer replays them layer by layer; `layer_counts` is `[L, T]` uint8, or None
    when every token-layer chose exactly K experts.
    """

    layers: npt.NDArray[Any]
    layer_counts: npt.NDArray[np.uint8] | None = None

    @property
    def ids(self) -> npt.NDArray[Any]:
        """`[T, L, K]` view of the ids."""
        return self.layers.transpose(1, 0, 2)

    @property
    def counts(self) -> npt.NDArray[np.uint8]:
        """`[T, L]` chosen slots per token-layer (0: no recorded route)."""
        if self.layer_counts is None:
            return np.full(self.layers.shape[1::-1], self.layers.shape[2], dtype=np.uint8)
        return self.layer_counts.T

    @property
    def num_tokens(self) -> int:
        return int(self.layers.shape[1])

    def slot_valid(self) -> npt.NDArray[np.bool_]:
        """`[L, T, K]` bool: which slots hold a chosen expert."""
        if self.layer_counts is None:
            return np.ones(self.layers.shape, dtype=bool)
        k = self.layers.shape[2]
        return np.arange(k, dtype=np.uint8) < self.layer_counts[:, :, None]

    def to_topk(self, fill: int = EMPTY, dtype: npt.DTypeLike = np.int16) -> npt.NDArray[Any]:
        """Token-major ids `[T, L, K]` as `dtype`, with `fill` in empty slots."""
        out = self.layers.astype(dtype)
        if self.layer_counts is not None:
            out[~self.slot_valid()] = fill
        return np.ascontiguousarray(out.transpose(1, 0, 2))

    @staticmethod
    def concat(parts: list[Routes]) -> Routes:
        """The routes of consecutive segments as one trajectory's."""
        if len(parts) == 1:
            return parts[0]
        layers = np.concatenate([p.layers for p in parts], axis=1)
        if all(p.layer_counts is None for p in parts):
            return Routes(layers)
        k = layers.shape[2]
        counts = [
            p.layer_counts
            if p.layer_counts is not None
            else np.full(p.layers.shape[:2], k, np.uint8)
            for p in parts
        ]
        return Routes(layers, np.concatenate(counts, axis=1))

    def equals(self, other: Routes) -> bool:
        """Same experts in the same slots and the same counts."""
        return (
            self.layers.shape == other.layers.shape
            and bool(np.array_equal(self.counts, other.counts))
            and bool(np.array_equal(self.to_topk(), other.to_topk()))
        )


@dataclass(frozen=True)
class EncodedRoutes:
    """The stored streams of one segment and a digest of its canonical content.

    `tokens`, when the producer sent token ids, is a zstd frame of `[T]` int32 LE (of
    the whole segment, prefix included). `dictionary`: the digest of the zstd dictionary
    the ids streams (this row's and its prefix's) need. `prefix`: the streams of the
    first `prefix_tokens` tokens, shared with other rows; the others then cover the
    tokens after them.
    """

    ids: bytes
    counts: bytes | None
    order: bytes | None
    transform: Transform
    digest: bytes
    tokens: bytes | None = None
    dictionary: bytes | None = None
    prefix: EncodedRoutes | None = None
    prefix_tokens: int = 0

    @property
    def nbytes(self) -> int:
        """Bytes of this row's own streams (a shared prefix not included)."""
        return sum(len(s or b"") for s in (self.ids, self.counts, self.order, self.tokens))


@dataclass(frozen=True)
class SentStreams:
    """What a client sends for one segment: the `codec.encode` streams, and (a direct
    write) the token ids as the `tokens` stream, a zstd frame of `[T]` int32 LE, and
    the digest of the namespace dictionary the ids stream was compressed with."""

    ids: bytes
    transform: int
    counts: bytes | None = None
    order: bytes | None = None
    tokens: bytes | None = None
    dictionary: bytes | None = None

    @classmethod
    def of(cls, encoded: EncodedRoutes, with_tokens: bool = False) -> SentStreams:
        tokens = encoded.tokens if with_tokens else None
        return cls(
            encoded.ids,
            int(encoded.transform),
            encoded.counts,
            encoded.order,
            tokens,
            encoded.dictionary,
        )


@dataclass(frozen=True, eq=False)
class Dictionary:
    """A zstd dictionary (`zstd -D` applies it too) and its digest, SHA-256[:16]."""

    data: bytes
    digest: bytes

    @staticmethod
    def of(data: bytes) -> Dictionary:
        return Dictionary(data, hashlib.sha256(data).digest()[:16])


Dictionaries = dict[bytes, Dictionary]  # by digest
