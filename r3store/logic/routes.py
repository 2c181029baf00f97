"""Routes in memory: validation and conversion between the forms engines emit.

Two input forms are accepted, both `[rows, L, ...]` with one row per token:

- top-k ids `[rows, L, K]` of any integer dtype. `-1` marks an empty slot; a
  token-layer whose slots are all `-1` has no recorded route.
- bit-packed masks `[rows, L, ceil(E / 8)]` uint8. Expert `e` is bit `e % 8` (least
  significant bit first) of byte `e // 8`, as `np.packbits(..., bitorder="little")`
  writes it. Bits past `E` in the last byte must be zero. A token-layer with no bit set
  has no recorded route. Masks are sets: an ordered namespace refuses them.

`rows` is the trajectory's token count, or one less: engines never feed back the last
sampled token, so they emit `num_tokens - 1` rows and the last token gets the
no-route marker.

The canonical form is `Routes`: for each token-layer, the chosen experts first (sorted
ascending for sets, in the producer's order when the spec keeps it; empty slots are
moved after the chosen ones), zeros in the empty slots, and a count of chosen slots
(0: no recorded route). It is held layer-major, `[L, T, K]`, as it is stored and as a
trainer replays it layer by layer; `Routes.ids` is the `[T, L, K]` view. `Routes` and
`EMPTY` are values of the vocabulary (`r3store.route_types`), importable from here too.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store.errors import InvalidRoutes
from r3store.route_types import EMPTY as EMPTY
from r3store.route_types import Routes as Routes
from r3store.spec import RouteSpec

SENTINEL = 0xFFFF  # sorts after every expert id (E <= 65535)


def _where(shape: tuple[int, ...], flat: int, names: tuple[str, ...], first_token: int) -> str:
    index = [int(i) for i in np.unravel_index(flat, shape)]
    index[0] += first_token  # token-major: the first axis is the token
    return ", ".join(f"{n} {i}" for n, i in zip(names, index, strict=True))


def _first(bad_lt: npt.NDArray[np.bool_], first_token: int) -> str:
    """Token-major position of the first True in a layer-major `[L, T]` array."""
    flat = int(np.flatnonzero(bad_lt.T)[0])
    return _where(bad_lt.T.shape, flat, ("token", "layer"), first_token)


def _check_shape(
    arr: npt.NDArray[Any], what: str, width: int, spec: RouteSpec, num_tokens: int
) -> None:
    """`arr` must be `[rows, L, width]`, a row per token (or for all but the last)."""
    want = (spec.num_layers, width)
    if arr.ndim != 3 or arr.shape[1:] != want:
        raise InvalidRoutes(
            f"{what} must have shape [rows, {want[0]}, {want[1]}], got {list(arr.shape)}"
        )
    rows = arr.shape[0]
    if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens < 1:
        raise InvalidRoutes(f"num_tokens must be a positive integer, got {num_tokens!r}")
    if rows not in (num_tokens, num_tokens - 1):
        raise InvalidRoutes(
            f"routes have {rows} rows but the trajectory has {num_tokens} tokens "
            f"(expected {num_tokens} or {num_tokens - 1} rows)"
        )


@functools.lru_cache(maxsize=64)
def sorting_network(n: int) -> tuple[tuple[int, int], ...]:
    """Batcher's odd-even merge sort comparators for `n` inputs (padded to a power of two)."""
    size = 1
    while size < n:
        size *= 2
    pairs: list[tuple[int, int]] = []
    p = 1
    while p < size:
        k = p
        while k >= 1:
            for j in range(k % p, size - k, 2 * k):
                for i in range(min(k, size - j - k)):
                    if (i + j) // (2 * p) == (i + j + k) // (2 * p):
                        pairs.append((i + j, i + j + k))
            k //= 2
        p *= 2
    return tuple((a, b) for a, b in pairs if b < n)


def sort_planes(planes: list[npt.NDArray[Any]]) -> list[npt.NDArray[Any]]:
    """Sort K same-shaped arrays element-wise with a vectorised sorting network.

    Far faster than `np.sort` along a short last axis: each comparator is one
    `np.minimum`/`np.maximum` over all token-layers at once.
    """
    planes = list(planes)
    for a, b in sorting_network(len(planes)):
        low = np.minimum(planes[a], planes[b])
        planes[b] = np.maximum(planes[a], planes[b])
        planes[a] = low
    return planes


def layer_planes(ids: npt.NDArray[Any], dtype: npt.DTypeLike) -> list[npt.NDArray[Any]]:
    """`[T, L, K]` -> K contiguous layer-major `[L, T]` arrays of `dtype`."""
    return list(np.ascontiguousarray(ids.astype(dtype, copy=False).transpose(2, 1, 0)))


def row_words(a: npt.NDArray[Any]) -> npt.NDArray[Any] | None:
    """A C-contiguous `[..., k]` array as `[...]` words: each row's k values one word of
    1, 2, 4 or 8 bytes, which a gather or a transpose moves as one value; None where a
    row is no such word or the array is not C-contiguous."""
    width = a.shape[-1] * a.itemsize
    if width not in (1, 2, 4, 8) or not a.flags.c_contiguous:
        return None
    words: npt.NDArray[Any] = a.view(f"u{width}").reshape(a.shape[:-1])
    return words


# values validated, converted or encoded at a time: temporaries stay a few hundred KiB
# however long the trajectory (a 200 MB upload must not cost gigabytes on the server),
# small enough to stay in a core's cache between the passes over them (measured:
# `bench/codec_bench.py`)
CHUNK_VALUES = 1 << 18

_Convert = Callable[[int, npt.NDArray[Any], npt.NDArray[np.uint8]], None]


def _assemble(
    rows: int, num_tokens: int, spec: RouteSpec, row_values: int, convert: _Convert
) -> Routes:
    """Canonical routes, built a chunk of rows at a time into preallocated arrays.

    `convert(first_token, layers, counts)` fills the `[L, n, K]` and `[L, n]` views of
    rows `first_token ..< first_token + n`. A row past `rows` (the last token, which
    engines do not route) keeps zeros and a count of 0: no recorded route.
    """
    layers = np.zeros((spec.num_layers, num_tokens, spec.top_k), spec.id_dtype)
    counts = np.zeros((spec.num_layers, num_tokens), np.uint8)
    step = max(1, CHUNK_VALUES // max(1, row_values))
    for begin in range(0, rows, step):
        end = min(rows, begin + step)
        convert(begin, layers[:, begin:end], counts[:, begin:end])
    full = rows == num_tokens and bool((counts == spec.top_k).all())
    return Routes(layers, None if full else counts)


def from_topk(ids: Any, spec: RouteSpec, num_tokens: int) -> Routes:
    """Validate top-k ids `[rows, L, K]` and return canonical `Routes`.

    Raises `InvalidRoutes` naming the first offending position. Ranges are checked on
    the values as sent, whatever their integer width.
    """
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise InvalidRoutes(f"top-k ids must be integers, got dtype {arr.dtype}")
    _check_shape(arr, "top-k ids", spec.top_k, spec, num_tokens)

    def convert(first: int, out: npt.NDArray[Any], out_counts: npt.NDArray[np.uint8]) -> None:
        _topk_rows(arr[first : first + out.shape[1]], spec, first, out, out_counts)

    return _assemble(arr.shape[0], num_tokens, spec, spec.num_layers * spec.top_k, convert)


def _topk_rows(
    part: npt.NDArray[Any],
    spec: RouteSpec,
    first: int,
    out: npt.NDArray[Any],
    out_counts: npt.NDArray[np.uint8],
) -> None:
    """Validate rows `[n, L, K]` (the first being token `first`) into `out` `[L, n, K]`."""
    counts = None
    if part.size and (int(part.min()) < 0 or int(part.max()) >= spec.num_experts):
        bad = (part < EMPTY) | (part >= spec.num_experts)  # on the values as sent, any width
        if bad.any():
            flat = int(np.flatnonzero(bad)[0])
            raise InvalidRoutes(
                f"expert id {int(part.flat[flat])} out of range [0, {spec.num_experts}) at "
                + _where(part.shape, flat, ("token", "layer", "slot"), first)
            )
        wide = part.astype(np.int32)  # every value is now in [-1, E)
        empty = wide == EMPTY
        counts = np.ascontiguousarray((spec.top_k - empty.sum(axis=-1, dtype=np.int32)).T)
        _check_counts(counts, spec, first)
        planes = layer_planes(np.where(empty, SENTINEL, wide), np.uint16)
    else:
        planes = layer_planes(part, spec.id_dtype)
    ranked = sort_planes(planes)
    for low, high in itertools.pairwise(ranked):
        dup = low == high
        if counts is not None:
            dup &= high != SENTINEL
        if dup.any():
            layer, token = np.unravel_index(int(np.flatnonzero(dup.T)[0]), dup.T.shape)[::-1]
            raise InvalidRoutes(
                f"expert {int(high[layer, token])} chosen twice at token {first + token}, "
                f"layer {layer}"
            )
    chosen = planes if spec.ordered else ranked
    if counts is None:
        for slot, plane in enumerate(chosen):
            out[..., slot] = plane
        out_counts[...] = spec.top_k
        return
    layers = np.stack(chosen, axis=-1)
    if spec.ordered:  # move empty slots after the chosen ones, keeping their order
        slot_order = np.argsort(layers == SENTINEL, axis=-1, kind="stable")
        layers = np.take_along_axis(layers, slot_order, axis=-1)
    layers[layers == SENTINEL] = 0
    out[...] = layers
    out_counts[...] = counts


def _check_counts(counts: npt.NDArray[Any], spec: RouteSpec, first: int) -> None:
    if spec.allow_fewer:
        return
    bad = (counts != 0) & (counts != spec.top_k)
    if bad.any():
        layer, token = np.unravel_index(int(np.flatnonzero(bad.T)[0]), bad.T.shape)[::-1]
        raise InvalidRoutes(
            f"token {first + token}, layer {layer} has {int(counts[layer, token])} experts; "
            f"the spec wants exactly {spec.top_k} (or none, for an unrecorded route)"
        )


def from_mask(mask: Any, spec: RouteSpec, num_tokens: int) -> Routes:
    """Validate bit-packed masks `[rows, L, ceil(E/8)]` and return canonical `Routes`."""
    if spec.ordered:
        raise InvalidRoutes(
            "this namespace keeps the top-k order; masks cannot carry it, send top-k ids"
        )
    arr = np.asarray(mask)
    if arr.dtype != np.uint8:
        raise InvalidRoutes(f"masks must be uint8, got dtype {arr.dtype}")
    _check_shape(arr, "masks", spec.mask_bytes, spec, num_tokens)

    def convert(first: int, out: npt.NDArray[Any], out_counts: npt.NDArray[np.uint8]) -> None:
        _mask_rows(arr[first : first + out.shape[1]], spec, first, out, out_counts)

    bits_per_row = spec.num_layers * spec.mask_bytes * 8
    return _assemble(arr.shape[0], num_tokens, spec, bits_per_row, convert)


def _mask_rows(
    part: npt.NDArray[np.uint8],
    spec: RouteSpec,
    first: int,
    out: npt.NDArray[Any],
    out_counts: npt.NDArray[np.uint8],
) -> None:
    """Validate mask rows `[n, L, B]` (the first being token `first`) into `out`."""
    lm = np.ascontiguousarray(part.transpose(1, 0, 2))  # [L, n, B]
    spare = spec.mask_bytes * 8 - spec.num_experts
    if spare:
        bad = (lm[..., -1] >> np.uint8(8 - spare)) != 0
        if bad.any():
            raise InvalidRoutes(
                f"bits set past expert {spec.num_experts - 1} at {_first(bad, first)}"
            )
    counts = np.bitwise_count(lm).sum(axis=-1, dtype=np.int32)
    too_many = counts > spec.top_k
    if too_many.any():
        layer, token = np.unravel_index(int(np.flatnonzero(too_many.T)[0]), too_many.T.shape)[::-1]
        raise InvalidRoutes(
            f"token {first + token}, layer {layer} has {int(counts[layer, token])} bits set; "
            f"top_k is {spec.top_k}"
        )
    _check_counts(counts, spec, first)
    rows = part.shape[0]
    n = spec.num_layers * rows
    flat_counts = counts.reshape(n)
    bits = np.unpackbits(lm.reshape(n, spec.mask_bytes), axis=-1, bitorder="little")
    row, expert = np.nonzero(bits)
    starts = np.zeros(n, dtype=np.int64)
    np.cumsum(flat_counts[:-1], out=starts[1:])
    ids = np.zeros((n, spec.top_k), dtype=spec.id_dtype)
    ids[row, np.arange(row.size, dtype=np.int64) - starts[row]] = expert
    out[...] = ids.reshape(spec.num_layers, rows, spec.top_k)
    out_counts[...] = counts


def to_mask(routes: Routes, spec: RouteSpec) -> npt.NDArray[np.uint8]:
    """Token-major bit-packed masks `[T, L, ceil(E/8)]` (bit order as in the module docstring)."""
    layers = routes.layers
    n_words = (spec.num_experts + 63) // 64
    words = np.zeros((n_words, *layers.shape[:2]), dtype=np.uint64)
    valid = None if routes.layer_counts is None else routes.slot_valid()
    for k in range(layers.shape[2]):
        ids = layers[..., k].astype(np.uint64)
        bit = np.left_shift(np.uint64(1), ids & np.uint64(63))
        if valid is not None:
            bit *= valid[..., k]
        word = ids >> np.uint64(6)
        for w in range(n_words):
            words[w] |= bit * (word == w) if n_words > 1 else bit
    packed = words.astype("<u8").transpose(2, 1, 0)  # [T, L, W]
    as_bytes = np.ascontiguousarray(packed).view(np.uint8)
    return np.ascontiguousarray(as_bytes[..., : spec.mask_bytes])
