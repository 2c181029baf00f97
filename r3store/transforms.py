"""The layouts of a segment's ids stream (docs/format.md, "Route streams"), one class
each, registered under the id a row stores (`route_transform`).

A transform takes the sorted ids `[L, T, K]` to the values its ids stream holds, a
chunk at a time (`forward`), and those values back to the sorted ids (`inverse`). The
codec (`r3store.logic.codec`) encodes and decodes through it; the checks of streams a
client encoded (`r3store.logic.streams`) and of read answers look ids up in
`TRANSFORMS` and undo the layout before checking. Which transforms are tried where is
named here too: `INGEST` (a sample compressed each way, the smaller kept),
`EVERY_TRANSFORM` (at rest: the whole stream each way, the smallest kept) and
`WITH_DICTIONARY` (a direct write compressed with the namespace dictionary).

A new transform is a `RouteTransform` subclass here, its id a member of `Transform`,
registered with `@register`, and its description in docs/format.md.

Pure numpy, no I/O.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Iterator
from enum import IntEnum
from typing import Any, ClassVar, TypeVar

import numpy as np
import numpy.typing as npt


class Transform(IntEnum):
    """The id a row stores for the layout of its ids stream."""

    SORTED = 0
    DELTA = 1
    TOKEN_MAJOR = 2  # sorted ids as `[T, L, K]`: at rest, and direct writes with a dictionary


class RouteTransform(ABC):
    """One layout of the ids stream: its id, the way there (`forward`) and back
    (`inverse`), and where it may be used."""

    id: ClassVar[Transform]
    # near-random bytes that only zstd's entropy coder shrinks: compressed at level 1,
    # where higher levels gain nothing (measured)
    fast: ClassVar[bool] = False
    # a read may hand out streams in it (else it encodes them again): it decodes with
    # what every client has
    served: ClassVar[bool] = True

    def applies(self, top_k: int) -> bool:
        """Whether it lays out routes of `top_k` slots otherwise than `Transform.SORTED`
        does (if not, the encoder does not pick it)."""
        return True

    @abstractmethod
    def forward(self, layers: npt.NDArray[Any], values: int) -> Iterator[npt.NDArray[Any]]:
        """The ids stream of the sorted ids `layers` `[L, T, K]`: contiguous parts of
        about `values` values each, in order."""

    @abstractmethod
    def inverse(self, ids: npt.NDArray[Any], shape: tuple[int, int, int]) -> npt.NDArray[Any]:
        """The sorted ids, flat and layer-major, of the values `ids` of an ids stream
        (flat, as decompressed, maybe read-only) of routes of `shape` `[L, T, K]`: `ids`
        itself when the layout is theirs, else a new array."""


TRANSFORMS: dict[int, RouteTransform] = {}  # by id
_T = TypeVar("_T", bound=type[RouteTransform])


def register(cls: _T) -> _T:
    """Class decorator: make `cls` the transform of its id."""
    if cls.id in TRANSFORMS:
        raise ValueError(f"route transform {int(cls.id)} is registered twice")
    TRANSFORMS[cls.id] = cls()
    return cls


@register
class Sorted(RouteTransform):
    """The sorted ids as they are, layer-major: each layer's expert popularity differs,
    and consecutive tokens of one layer repeat sets."""

    id = Transform.SORTED

    def forward(self, layers: npt.NDArray[Any], values: int) -> Iterator[npt.NDArray[Any]]:
        flat = layers.reshape(-1)
        k = layers.shape[2]
        step = max(1, values // k) * k  # whole token-layers
        for begin in range(0, flat.size, step):
            yield flat[begin : begin + step]

    def inverse(self, ids: npt.NDArray[Any], shape: tuple[int, int, int]) -> npt.NDArray[Any]:
        return ids


@register
class Delta(Sorted):
    """Per token-layer gaps: slot k > 0 holds `(x[k] - x[k-1] - 1) mod 2**bits`.
    Near-uniform routes compress better as gaps, routes whose sets recur as ids."""

    id = Transform.DELTA
    fast = True

    def applies(self, top_k: int) -> bool:
        return top_k > 1  # with one slot the gaps are the ids themselves

    def forward(self, layers: npt.NDArray[Any], values: int) -> Iterator[npt.NDArray[Any]]:
        k = layers.shape[2]
        for part in super().forward(layers, values):
            yield delta(part, k)

    def inverse(self, ids: npt.NDArray[Any], shape: tuple[int, int, int]) -> npt.NDArray[Any]:
        out = ids.copy()
        undelta(out, shape[2])
        return out


@register
class TokenMajor(RouteTransform):
    """The sorted ids as `[T, L, K]`: a token's sets of all layers lie together, so
    text that recurs (and with it its routes through every layer) makes long matches.
    Only shards at rest and direct writes hold it."""

    id = Transform.TOKEN_MAJOR
    served = False

    def forward(self, layers: npt.NDArray[Any], values: int) -> Iterator[npt.NDArray[Any]]:
        num_layers, num_tokens, k = layers.shape
        step = max(1, values // (num_layers * k))  # whole tokens
        for begin in range(0, num_tokens, step):
            yield np.ascontiguousarray(layers[:, begin : begin + step].transpose(1, 0, 2))

    def inverse(self, ids: npt.NDArray[Any], shape: tuple[int, int, int]) -> npt.NDArray[Any]:
        num_layers, num_tokens, k = shape
        token_major = ids.reshape(num_tokens, num_layers, k)
        return np.ascontiguousarray(token_major.transpose(1, 0, 2)).reshape(-1)


# Which transforms are tried where; on equal sizes, the first.
INGEST = (Transform.SORTED, Transform.DELTA)  # a sample of each: uploads, ingest
EVERY_TRANSFORM = (Transform.SORTED, Transform.TOKEN_MAJOR, Transform.DELTA)  # at rest
WITH_DICTIONARY = (Transform.TOKEN_MAJOR,)  # a direct write's, with the namespace's


def delta(flat: npt.NDArray[Any], k: int) -> npt.NDArray[Any]:
    """Per token-layer gaps: slot j > 0 becomes `x[j] - x[j-1] - 1` (mod 2**bits)."""
    out = np.empty_like(flat)
    with np.errstate(over="ignore"):
        np.subtract(flat[1:], flat[:-1], out=out[1:])
        out -= out.dtype.type(1)
    out[::k] = flat[::k]
    return out


@functools.lru_cache(maxsize=32)
def _slot_pattern(k: int, step: int, itemsize: int, size: int) -> npt.NDArray[Any]:
    """`size` values, 1 where the slot index within its token-layer is >= step, else 0."""
    dtype = np.dtype(f"u{itemsize}")
    return np.tile((np.arange(k) >= step).astype(dtype), size // k)


_PATTERN_TOKENS = 1 << 15


def undelta(flat: npt.NDArray[Any], k: int) -> None:
    """Invert `delta` in place: a prefix sum within each token-layer (Hillis-Steele)."""
    chunk = k * _PATTERN_TOKENS
    with np.errstate(over="ignore"):
        for start in range(0, flat.size, chunk):
            part = flat[start : start + chunk]
            n = part.size
            part += _slot_pattern(k, 1, flat.itemsize, chunk)[:n]
            step = 1
            while step < k:
                carry = part[:-step] * _slot_pattern(k, step, flat.itemsize, chunk)[step:n]
                part[step:] += carry
                step *= 2
