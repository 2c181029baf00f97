"""The storage encoding of one trajectory's routes.

Chosen by measurement (see `bench/codec_bench.py` and docs/format.md): sorted ids in
layer-major order compress best with zstd, because each layer's expert popularity
differs and consecutive tokens of one layer repeat sets. Three streams, each a zstd
frame:

- ``ids``: `[L, T, K]` of the id dtype (uint8 when E <= 256, else little-endian uint16),
  each token-layer's chosen experts ascending, then zeros in empty slots. With transform
  ``DELTA`` slot k > 0 holds `(x[k] - x[k-1] - 1) mod 2**bits` instead of `x[k]`;
  near-uniform routes compress better as gaps, routes whose sets recur as plain ids, and
  the encoder picks per trajectory by compressing a sample both ways. At rest
  (`EVERY_TRANSFORM`) transform ``TOKEN_MAJOR`` is tried too: the sorted ids as
  `[T, L, K]`, where a token's sets of all layers lie together, so text that recurs
  (and with it its routes through every layer) makes long matches. Gaps
  are near-random bytes that only the entropy coder shrinks, so they are compressed at
  level 1 (higher levels gain nothing there, measured); plain ids at `level` (default
  3), whose longer match search finds the recurring sets.
- ``counts``: `[L, T]` uint8, how many slots are chosen (0: no recorded route); absent
  when every token-layer has K experts.
- ``order`` (ordered specs only): for K <= 8, `[L, T]` uint16 Lehmer ranks of the
  producer's slot order (log2(K!) bits of information in 16); for K > 8, `[L, T, K]`
  uint8 where slot i of the producer's order holds sorted slot `order[i]`.

At rest (`r3store.logic.rest`) two things may change: the ids stream is compressed with a
namespace's zstd `Dictionary` (named by its digest in `EncodedRoutes.dictionary`), and
a row may hold only the tokens after a prefix it shares with other samples of its
group (`EncodedRoutes.prefix`: the streams of the first `prefix_tokens` tokens, stored
once in the shard). Decoding puts the two parts back together.

All of it is pure: bytes in, arrays out, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import math
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3store.errors import CorruptShard
from r3store.logic.routes import CHUNK_VALUES, SENTINEL, Routes, sort_planes
from r3store.spec import RouteSpec

LEHMER_MAX_K = 8
SAMPLE_BYTES = 64 * 1024
DEFAULT_LEVEL = 3


class Transform(IntEnum):
    SORTED = 0
    DELTA = 1
    TOKEN_MAJOR = 2  # sorted ids as `[T, L, K]`: at rest, and direct writes with a dictionary


EVERY_TRANSFORM = (Transform.SORTED, Transform.TOKEN_MAJOR, Transform.DELTA)


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


@dataclass(frozen=True, eq=False)
class Dictionary:
    """A zstd dictionary (`zstd -D` applies it too) and its digest, SHA-256[:16]."""

    data: bytes
    digest: bytes

    @staticmethod
    def of(data: bytes) -> Dictionary:
        return Dictionary(data, hashlib.sha256(data).digest()[:16])

    @functools.cached_property
    def _zdict(self) -> zstandard.ZstdCompressionDict:
        return zstandard.ZstdCompressionDict(self.data)

    def compressor(self, level: int) -> zstandard.ZstdCompressor:
        cache: dict[tuple[bytes, int], zstandard.ZstdCompressor] = _local.__dict__.setdefault(
            "dict_compressors", {}
        )
        if (self.digest, level) not in cache:
            cache[(self.digest, level)] = zstandard.ZstdCompressor(
                level=level, dict_data=self._zdict
            )
        return cache[(self.digest, level)]

    def decompressor(self) -> zstandard.ZstdDecompressor:
        cache: dict[bytes, zstandard.ZstdDecompressor] = _local.__dict__.setdefault(
            "dict_decompressors", {}
        )
        if self.digest not in cache:
            if len(cache) >= 64:
                cache.clear()
            cache[self.digest] = zstandard.ZstdDecompressor(dict_data=self._zdict)
        return cache[self.digest]


_local = threading.local()
Dictionaries = dict[bytes, "Dictionary"]  # by digest


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("compressors", {})
    if level not in cache:
        cache[level] = zstandard.ZstdCompressor(level=level)
    return cache[level]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "decompressor"):
        _local.decompressor = zstandard.ZstdDecompressor()
    return _local.decompressor  # type: ignore[no-any-return]


@functools.lru_cache(maxsize=LEHMER_MAX_K)
def lehmer_table(k: int) -> npt.NDArray[np.uint8]:
    """`[k!, k]`: row r is the permutation whose Lehmer rank is r (slot i <- sorted p[i])."""
    table = np.empty((math.factorial(k), k), dtype=np.uint8)
    for rank in range(table.shape[0]):
        remaining = list(range(k))
        rest = rank
        for i in range(k):
            digit, rest = divmod(rest, math.factorial(k - 1 - i))
            table[rank, i] = remaining.pop(digit)
    return table


def _lehmer_rank(planes: list[npt.NDArray[Any]]) -> npt.NDArray[np.uint16]:
    """Rank of each token-layer's slot order: digit i counts later slots holding less."""
    k = len(planes)
    rank = np.zeros(planes[0].shape, dtype=np.uint16)
    for i in range(k - 1):
        digit = np.zeros(planes[0].shape, dtype=np.uint8)
        for j in range(i + 1, k):
            np.add(digit, planes[j] < planes[i], out=digit, casting="unsafe")
        rank += digit.astype(np.uint16) * np.uint16(math.factorial(k - 1 - i))
    return rank


def encode(
    routes: Routes,
    spec: RouteSpec,
    level: int = DEFAULT_LEVEL,
    salt: bytes = b"",
    token_ids: npt.NDArray[np.int32] | None = None,
    digest: bool = True,
    dictionary: Dictionary | None = None,
    transforms: Sequence[Transform] | None = None,
) -> EncodedRoutes:
    """Encode canonical routes (as `r3store.logic.routes` makes them) into storage streams
    (`digest=False`: leave the digest empty, for a client whose server computes it).
    With a `dictionary`, the ids stream is compressed with it at `level`, both ways
    tried (sorted ids and gaps). With `transforms` (at rest: `EVERY_TRANSFORM`) the ids
    stream is compressed whole in each of them, and the smallest kept.

    The digest covers the canonical content (not the compressed bytes) and `salt`,
    which callers use for the trajectory's metadata. Work goes a chunk of tokens at a
    time: besides the routes, memory holds little more than the compressed streams.
    """
    layers = np.ascontiguousarray(routes.layers, dtype=spec.id_dtype)
    counts = routes.layer_counts
    order_raw: memoryview | None = None
    if spec.ordered:
        layers, order = _split_order(layers, counts, spec)
        order_raw = order.reshape(-1).view(np.uint8).data  # len() in bytes, as digested
    raw = layers.reshape(-1)
    counts_raw = b"" if counts is None else np.ascontiguousarray(counts, np.uint8).tobytes()
    tokens_raw = b"" if token_ids is None else token_ids.astype("<i4").tobytes()
    content = (
        content_digest(spec, raw, layers.shape, counts_raw, order_raw or b"", tokens_raw, salt)
        if digest
        else b""
    )

    compressor, fast = _compressor(level), _compressor(1)
    if dictionary is not None:
        compressor = fast = dictionary.compressor(level)
    k = spec.top_k
    if transforms:
        if k == 1:  # gaps are the ids themselves
            transforms = [t for t in transforms if t != Transform.DELTA] or [Transform.SORTED]
        tried = [
            (_compress_ids(fast if t == Transform.DELTA else compressor, layers, t), t)
            for t in transforms
        ]
        ids_z, transform = min(tried, key=lambda c: len(c[0]))
    else:
        sample = (SAMPLE_BYTES // raw.itemsize) // k * k
        plain_n = len(compressor.compress(raw[:sample].data))
        delta_n = len(fast.compress(_delta(raw[:sample], k).data))
        if k > 1 and delta_n < plain_n:
            transform, ids_z = Transform.DELTA, _compress_ids(fast, layers, Transform.DELTA)
        else:
            transform, ids_z = Transform.SORTED, _compress_ids(compressor, layers, Transform.SORTED)
    return EncodedRoutes(
        ids=ids_z,
        counts=None if counts is None else _compressor(level).compress(counts_raw),
        order=None if order_raw is None else _compressor(level).compress(order_raw),
        transform=transform,
        digest=content,
        tokens=compress_tokens(token_ids),
        dictionary=None if dictionary is None else dictionary.digest,
    )


def load_dictionary(data: bytes, digest: bytes) -> Dictionary:
    """A dictionary read back, checked against the digest it is named by."""
    dictionary = Dictionary.of(data)
    if dictionary.digest != digest:
        raise CorruptShard(f"dictionary {digest.hex()} holds other bytes")
    return dictionary


def self_contained(encoded: EncodedRoutes) -> bool:
    """Whether the streams decode alone (no dictionary, no shared prefix) in a transform
    clients may be sent (not token-major, which only shards at rest hold)."""
    return (
        encoded.dictionary is None
        and encoded.prefix is None
        and encoded.transform != Transform.TOKEN_MAJOR
    )


def portable(
    encoded: EncodedRoutes, spec: RouteSpec, num_tokens: int, dictionary: Dictionary | None
) -> EncodedRoutes:
    """Streams that decode alone (`self_contained`), encoded again at level 1 when
    `encoded` is not; digest and token ids unchanged."""
    if self_contained(encoded):
        return encoded
    again = encode(decode(encoded, spec, num_tokens, dictionary), spec, 1, digest=False)
    return dataclasses.replace(again, digest=encoded.digest, tokens=encoded.tokens)


def layer_subset(
    encoded: EncodedRoutes,
    spec: RouteSpec,
    num_tokens: int,
    layers: Sequence[int],
    dictionary: Dictionary | None = None,
) -> EncodedRoutes:
    """The streams of `layers` only (indices into the spec's layers), encoded again at
    level 1 for `spec.narrowed(len(layers))`: what a rank whose routers see those
    layers reads. Digest and token ids unchanged (they name the stored segment).
    `dictionary`: the one stored streams need (`portable`'s)."""
    routes = decode(encoded, spec, num_tokens, dictionary)
    chosen = list(layers)
    counts = None if routes.layer_counts is None else routes.layer_counts[chosen]
    subset = Routes(np.ascontiguousarray(routes.layers[chosen]), counts)
    again = encode(subset, spec.narrowed(len(chosen)), 1, digest=False)
    return dataclasses.replace(again, digest=encoded.digest, tokens=encoded.tokens)


def sorted_ids(routes: Routes, spec: RouteSpec) -> npt.NDArray[Any]:
    """`[L, T, K]`: what the ids stream holds before compression (the sets, sorted)."""
    layers = np.ascontiguousarray(routes.layers, dtype=spec.id_dtype)
    return _split_order(layers, routes.layer_counts, spec)[0] if spec.ordered else layers


def compress_tokens(token_ids: npt.NDArray[np.int32] | None) -> bytes | None:
    """The `tokens` stream: a zstd frame of `[T]` int32 LE, or None."""
    return None if token_ids is None else _compressor(1).compress(token_ids.astype("<i4").tobytes())


def content_digest(
    spec: RouteSpec,
    sorted_ids: npt.NDArray[Any],
    shape: tuple[int, ...],
    counts_raw: bytes,
    order_raw: bytes | memoryview,
    tokens_raw: bytes,
    salt: bytes,
) -> bytes:
    """The digest of a segment's canonical content (docs/format.md, "Digest"): the
    sorted ids `[L, T, K]` (flat), counts (empty when all are K), order and token bytes,
    and `salt` (the metadata), each after its length."""
    digest = hashlib.sha256()
    digest.update(spec.id_dtype.str.encode() + np.array(shape, np.int64).tobytes())
    for part in (sorted_ids.data, counts_raw, order_raw, tokens_raw, salt):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.digest()[:16]


def _compress_ids(
    compressor: zstandard.ZstdCompressor, layers: npt.NDArray[Any], transform: Transform
) -> bytes:
    """One zstd frame of the ids stream of sorted ids `layers` `[L, T, K]` under
    `transform`, fed a chunk at a time."""
    sink = io.BytesIO()  # grows in place; getvalue() hands over its buffer, no copy
    num_layers, num_tokens, k = layers.shape
    with compressor.stream_writer(sink, size=layers.nbytes, closefd=False) as stream:
        if transform == Transform.TOKEN_MAJOR:
            step = max(1, CHUNK_VALUES // (num_layers * k))  # whole tokens
            for begin in range(0, num_tokens, step):
                part = layers[:, begin : begin + step].transpose(1, 0, 2)
                stream.write(np.ascontiguousarray(part).data)
        else:
            flat = layers.reshape(-1)
            step = max(1, CHUNK_VALUES // k) * k  # whole token-layers
            for begin in range(0, flat.size, step):
                part = flat[begin : begin + step]
                stream.write((_delta(part, k) if transform == Transform.DELTA else part).data)
    return sink.getvalue()


def _split_order(
    layers: npt.NDArray[Any], counts: npt.NDArray[np.uint8] | None, spec: RouteSpec
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Ordered routes `[L, T, K]` as sorted sets and the producer's slot order (Lehmer
    ranks `[L, T]` uint16 for K <= 8, else `[L, T, K]` uint8 positions)."""
    k = spec.top_k
    ordered = np.empty_like(layers)
    order = np.empty(layers.shape[:2] if k <= LEHMER_MAX_K else layers.shape, _order_dtype(k))
    step = max(1, CHUNK_VALUES // (layers.shape[0] * k))
    for begin in range(0, layers.shape[1], step):
        part = layers[:, begin : begin + step]
        planes = [part[..., i].astype(np.uint16) for i in range(k)]
        if counts is not None:
            for i, plane in enumerate(planes):
                plane[counts[:, begin : begin + step] <= i] = SENTINEL
        ranked = sort_planes(planes)
        if k <= LEHMER_MAX_K:
            order[:, begin : begin + step] = _lehmer_rank(planes)
        else:
            work = np.stack(planes, axis=-1)
            order[:, begin : begin + step] = np.argsort(
                np.argsort(work, axis=-1, kind="stable"), axis=-1
            )
        for i, plane in enumerate(ranked):
            ordered[:, begin : begin + step, i] = np.where(plane == SENTINEL, 0, plane)
    return ordered, order


def _order_dtype(k: int) -> type[np.unsignedinteger[Any]]:
    return np.uint16 if k <= LEHMER_MAX_K else np.uint8


def decode_tokens(blob: bytes, num_tokens: int) -> npt.NDArray[np.int32]:
    """The `[T]` int32 token ids of a `tokens` stream."""
    raw = _unzstd(blob, num_tokens * 4, "tokens")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def _delta(flat: npt.NDArray[Any], k: int) -> npt.NDArray[Any]:
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
    """Invert `_delta` in place: a prefix sum within each token-layer (Hillis-Steele)."""
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


def _unzstd(blob: bytes, expected: int, what: str, dictionary: Dictionary | None = None) -> bytes:
    decompressor = _decompressor() if dictionary is None else dictionary.decompressor()
    try:
        data = decompressor.decompress(blob, max_output_size=expected)
    except zstandard.ZstdError as exc:
        raise CorruptShard(f"cannot decompress the {what} stream: {exc}") from exc
    if len(data) != expected:
        raise CorruptShard(f"the {what} stream holds {len(data)} bytes, expected {expected}")
    return data


def decode(
    encoded: EncodedRoutes,
    spec: RouteSpec,
    num_tokens: int,
    dictionary: Dictionary | None = None,
) -> Routes:
    """Decode storage streams back into canonical `Routes` (ids as a layer-major view).
    `dictionary` is the one `encoded.dictionary` names, when it names one."""
    if encoded.dictionary is not None and (
        dictionary is None or dictionary.digest != encoded.dictionary
    ):
        raise CorruptShard(
            f"the ids stream needs dictionary {encoded.dictionary.hex()}, "
            f"given {'none' if dictionary is None else dictionary.digest.hex()}"
        )
    if encoded.prefix is not None:
        head = encoded.prefix_tokens
        if not 0 < head < num_tokens or encoded.prefix.prefix is not None:
            raise CorruptShard(f"a prefix of {head} tokens in a segment of {num_tokens}")
        own = dataclasses.replace(encoded, prefix=None, prefix_tokens=0)
        return Routes.concat(
            [
                decode(encoded.prefix, spec, head, dictionary),
                decode(own, spec, num_tokens - head, dictionary),
            ]
        )
    ids_z, counts_z, order_z = encoded.ids, encoded.counts, encoded.order
    transform = int(encoded.transform)
    layers, k = spec.num_layers, spec.top_k
    shape = (layers, num_tokens, k)
    n_ids = layers * num_tokens * k
    raw = _unzstd(
        ids_z,
        n_ids * spec.id_dtype.itemsize,
        "ids",
        None if encoded.dictionary is None else dictionary,
    )
    ids = np.frombuffer(raw, dtype=spec.id_dtype)
    if transform == Transform.TOKEN_MAJOR:
        ids = np.ascontiguousarray(ids.reshape(num_tokens, layers, k).transpose(1, 0, 2))
        ids = ids.reshape(-1)
    else:
        ids = ids.copy()
    if transform == Transform.DELTA:
        undelta(ids, k)
    elif transform not in (Transform.SORTED, Transform.TOKEN_MAJOR):
        raise CorruptShard(f"unknown route transform {transform}")
    counts = None
    if counts_z is not None:
        counts_raw = _unzstd(counts_z, layers * num_tokens, "counts")
        counts = np.frombuffer(counts_raw, dtype=np.uint8).reshape(layers, num_tokens)
    if spec.ordered:
        if order_z is None:
            raise CorruptShard("an ordered spec's row has no order stream")
        if k <= LEHMER_MAX_K:
            ranks_raw = _unzstd(order_z, layers * num_tokens * 2, "order")
            ranks = np.frombuffer(ranks_raw, dtype=np.uint16).reshape(layers, num_tokens)
            if k > 1 and int(ranks.max(initial=0)) >= math.factorial(k):
                raise CorruptShard("order stream holds a rank past k!")
            perm = lehmer_table(k)[ranks]
        else:
            perm_raw = _unzstd(order_z, n_ids, "order")
            perm = np.frombuffer(perm_raw, dtype=np.uint8).reshape(shape)
        base = np.arange(0, n_ids, k, dtype=np.intp).reshape(layers, num_tokens, 1)
        ids = ids[perm + base]
    return Routes(ids.reshape(shape), counts)
