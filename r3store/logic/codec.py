"""The storage encoding of one trajectory's routes.

Chosen by measurement (see `bench/codec_bench.py` and docs/format.md): sorted ids in
layer-major order compress best with zstd, because each layer's expert popularity
differs and consecutive tokens of one layer repeat sets. Three streams, each a zstd
frame:

- ``ids``: `[L, T, K]` of the id dtype (uint8 when E <= 256, else little-endian uint16),
  each token-layer's chosen experts ascending, then zeros in empty slots, laid out by
  one of the transforms of `r3store.transforms` (the row's `transform`): as they are
  (``SORTED``), as gaps within each token-layer (``DELTA``: near-uniform routes compress
  better as gaps, routes whose sets recur as plain ids), or token-major
  (``TOKEN_MAJOR``, at rest: text that recurs makes long matches). At ingest the
  encoder picks per trajectory by compressing a sample each way (`transforms.INGEST`);
  at rest (`EVERY_TRANSFORM`) the whole stream is compressed each way and the smallest
  kept. Gaps are near-random bytes that only the entropy coder shrinks, so they are
  compressed at level 1 (higher levels gain nothing there, measured); plain ids at
  `level` (default 3), whose longer match search finds the recurring sets.
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

The values are the vocabulary's (`r3store.route_types`: `EncodedRoutes`, `Dictionary`;
`r3store.transforms`: `Transform`, `EVERY_TRANSFORM`), importable from here too. All of
it is pure: bytes in, arrays out, no I/O.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import itertools
import math
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3store.errors import CorruptShard
from r3store.logic.routes import CHUNK_VALUES, SENTINEL, row_words, sort_planes
from r3store.route_types import Dictionaries as Dictionaries
from r3store.route_types import Dictionary as Dictionary
from r3store.route_types import EncodedRoutes as EncodedRoutes
from r3store.route_types import Routes
from r3store.spec import RouteSpec
from r3store.transforms import EVERY_TRANSFORM as EVERY_TRANSFORM
from r3store.transforms import INGEST, TRANSFORMS, RouteTransform
from r3store.transforms import Transform as Transform

LEHMER_MAX_K = 8
UNSORT_CELLS = 8192  # token-layers put back in slot order at a time (measured fastest)
SAMPLE_BYTES = 64 * 1024
DEFAULT_LEVEL = 3

_local = threading.local()


def compressor(level: int, dictionary: Dictionary | None = None) -> zstandard.ZstdCompressor:
    """A zstd compressor at `level`, with `dictionary` when given: one per thread."""
    key = (b"" if dictionary is None else dictionary.digest, level)
    cache: dict[tuple[bytes, int], zstandard.ZstdCompressor] = _local.__dict__.setdefault(
        "compressors", {}
    )
    if key not in cache:
        cache[key] = (
            zstandard.ZstdCompressor(level=level)
            if dictionary is None
            else zstandard.ZstdCompressor(level=level, dict_data=_zdict(dictionary))
        )
    return cache[key]


def decompressor(dictionary: Dictionary | None = None) -> zstandard.ZstdDecompressor:
    """A zstd decompressor, with `dictionary` when given: one per thread."""
    if dictionary is None:
        if not hasattr(_local, "decompressor"):
            _local.decompressor = zstandard.ZstdDecompressor()
        return _local.decompressor  # type: ignore[no-any-return]
    cache: dict[bytes, zstandard.ZstdDecompressor] = _local.__dict__.setdefault(
        "dict_decompressors", {}
    )
    if dictionary.digest not in cache:
        if len(cache) >= 64:
            cache.clear()
        cache[dictionary.digest] = zstandard.ZstdDecompressor(dict_data=_zdict(dictionary))
    return cache[dictionary.digest]


def _zdict(dictionary: Dictionary) -> zstandard.ZstdCompressionDict:
    return zstandard.ZstdCompressionDict(dictionary.data)


@functools.lru_cache(maxsize=LEHMER_MAX_K)
def lehmer_table(k: int) -> npt.NDArray[np.uint8]:
    """`[k!, k]`: row r is the permutation whose Lehmer rank is r (slot i <- sorted p[i]):
    the r-th in lexicographic order, as `itertools.permutations` lists them."""
    table = np.array(list(itertools.permutations(range(k))), dtype=np.uint8)
    table.flags.writeable = False  # one table, shared by every decoding thread
    return table.reshape(math.factorial(k), k)


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
    With a `dictionary`, the ids stream is compressed with it at `level`, every way
    tried. With `transforms` (at rest: `EVERY_TRANSFORM`) the ids stream is compressed
    whole in each of them, and the smallest kept; else in the one of `INGEST` that
    compresses a sample smallest.

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

    ids_z, transform = _ids_stream(layers, level, dictionary, transforms)
    return EncodedRoutes(
        ids=ids_z,
        counts=None if counts is None else compressor(level).compress(counts_raw),
        order=None if order_raw is None else compressor(level).compress(order_raw),
        transform=transform.id,
        digest=content,
        tokens=compress_tokens(token_ids),
        dictionary=None if dictionary is None else dictionary.digest,
    )


def _ids_stream(
    layers: npt.NDArray[Any],
    level: int,
    dictionary: Dictionary | None,
    transforms: Sequence[Transform] | None,
) -> tuple[bytes, RouteTransform]:
    """The ids stream of sorted ids `layers` `[L, T, K]` and its transform: of
    `transforms`, each compressed whole, the smallest; else the one of `INGEST` whose
    first `SAMPLE_BYTES` compress smallest. On equal sizes, the first."""
    k = layers.shape[2]
    candidates = [TRANSFORMS[t] for t in transforms or INGEST if TRANSFORMS[t].applies(k)]
    candidates = candidates or [TRANSFORMS[Transform.SORTED]]

    def zstd(transform: RouteTransform) -> zstandard.ZstdCompressor:
        fast = transform.fast and dictionary is None
        return compressor(1 if fast else level, dictionary)

    if transforms:
        tried = [(_compress_ids(zstd(t), layers, t), t) for t in candidates]
        return min(tried, key=lambda c: len(c[0]))
    sample = (SAMPLE_BYTES // layers.itemsize) // k * k

    def sampled(transform: RouteTransform) -> int:
        first = next(transform.forward(layers, sample), layers.reshape(-1)[:0])
        return len(zstd(transform).compress(first.data))

    best = min(candidates, key=sampled)
    return _compress_ids(zstd(best), layers, best), best


def load_dictionary(data: bytes, digest: bytes) -> Dictionary:
    """A dictionary read back, checked against the digest it is named by."""
    dictionary = Dictionary.of(data)
    if dictionary.digest != digest:
        raise CorruptShard(f"dictionary {digest.hex()} holds other bytes")
    return dictionary


def self_contained(encoded: EncodedRoutes) -> bool:
    """Whether the streams decode alone (no dictionary, no shared prefix) in a transform
    clients may be sent (`RouteTransform.served`: not token-major, which only shards at
    rest and direct writes hold)."""
    transform = TRANSFORMS.get(encoded.transform)
    return (
        encoded.dictionary is None
        and encoded.prefix is None
        and transform is not None
        and transform.served
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
    return None if token_ids is None else compressor(1).compress(token_ids.astype("<i4").tobytes())


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
    compressor: zstandard.ZstdCompressor, layers: npt.NDArray[Any], transform: RouteTransform
) -> bytes:
    """One zstd frame of the ids stream of sorted ids `layers` `[L, T, K]` under
    `transform`, fed a chunk at a time."""
    sink = io.BytesIO()  # grows in place; getvalue() hands over its buffer, no copy
    with compressor.stream_writer(sink, size=layers.nbytes, closefd=False) as stream:
        for part in transform.forward(layers, CHUNK_VALUES):
            stream.write(part.data)
    return sink.getvalue()


def _split_order(
    layers: npt.NDArray[Any], counts: npt.NDArray[np.uint8] | None, spec: RouteSpec
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """Ordered routes `[L, T, K]` as sorted sets and the producer's slot order (Lehmer
    ranks `[L, T]` uint16 for K <= 8, else `[L, T, K]` uint8 positions). Every
    token-layer is first taken as holding K experts, in the ids' own width; those with
    fewer (the last token, which engines do not route) are then done again alone, their
    empty slots kept last."""
    k = spec.top_k
    ordered = np.empty_like(layers)
    order = np.empty(layers.shape[:2] if k <= LEHMER_MAX_K else layers.shape, _order_dtype(k))
    step = max(1, CHUNK_VALUES // (layers.shape[0] * k))
    for begin in range(0, layers.shape[1], step):
        window = slice(begin, begin + step)
        part = layers[:, window]
        planes = [np.ascontiguousarray(part[..., i]) for i in range(k)]
        ordered[:, window] = np.stack(sort_planes(planes), axis=-1)
        order[:, window] = _slot_order(planes)
        if counts is None:
            continue
        held = counts[:, window]
        partial = np.nonzero(held < k)
        if partial[0].size:
            sets, ranks = _split_partial(part[partial], held[partial], k)
            ordered[:, window][partial] = sets
            order[:, window][partial] = ranks
    return ordered, order


def _split_partial(
    rows: npt.NDArray[Any], held: npt.NDArray[np.uint8], k: int
) -> tuple[npt.NDArray[Any], npt.NDArray[Any]]:
    """`_split_order` of token-layers `[m, K]` holding `held` experts each: their empty
    slots sort last (a sentinel above every id), then hold 0."""
    planes = [rows[:, i].astype(np.uint16) for i in range(k)]
    for i, plane in enumerate(planes):
        plane[held <= i] = SENTINEL
    ranked = np.stack(sort_planes(planes), axis=-1)
    sets = np.where(ranked == SENTINEL, 0, ranked).astype(rows.dtype)
    return sets, _slot_order(planes)


def _slot_order(planes: list[npt.NDArray[Any]]) -> npt.NDArray[Any]:
    """The slot order of K planes: Lehmer ranks (K <= 8), else each slot's position."""
    if len(planes) <= LEHMER_MAX_K:
        return _lehmer_rank(planes)
    work = np.stack(planes, axis=-1)
    positions: npt.NDArray[Any] = np.argsort(np.argsort(work, axis=-1, kind="stable"), axis=-1)
    return positions


def _order_dtype(k: int) -> type[np.unsignedinteger[Any]]:
    return np.uint16 if k <= LEHMER_MAX_K else np.uint8


def decode_tokens(blob: bytes, num_tokens: int) -> npt.NDArray[np.int32]:
    """The `[T]` int32 token ids of a `tokens` stream."""
    raw = _unzstd(blob, num_tokens * 4, "tokens")
    return np.frombuffer(raw, dtype="<i4").astype(np.int32)


def _unzstd(blob: bytes, expected: int, what: str, dictionary: Dictionary | None = None) -> bytes:
    try:
        data = decompressor(dictionary).decompress(blob, max_output_size=expected)
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
        return _decode_prefixed(encoded, encoded.prefix, spec, num_tokens, dictionary)
    transform = TRANSFORMS.get(encoded.transform)
    if transform is None:
        raise CorruptShard(f"unknown route transform {int(encoded.transform)}")
    layers, k = spec.num_layers, spec.top_k
    shape = (layers, num_tokens, k)
    raw = _unzstd(
        encoded.ids,
        layers * num_tokens * k * spec.id_dtype.itemsize,
        "ids",
        None if encoded.dictionary is None else dictionary,
    )
    ids = transform.inverse(np.frombuffer(raw, dtype=spec.id_dtype), shape)
    counts = None
    if encoded.counts is not None:
        counts_raw = _unzstd(encoded.counts, layers * num_tokens, "counts")
        counts = np.frombuffer(counts_raw, dtype=np.uint8).reshape(layers, num_tokens)
    if spec.ordered:
        ids = _unsort(ids, encoded.order, spec, num_tokens)  # a new array
    elif not ids.flags.writeable:  # still the decompressed bytes
        ids = ids.copy()
    return Routes(ids.reshape(shape), counts)


def _decode_prefixed(
    encoded: EncodedRoutes,
    prefix: EncodedRoutes,
    spec: RouteSpec,
    num_tokens: int,
    dictionary: Dictionary | None,
) -> Routes:
    """`decode` of a row that continues a shared `prefix` (its `prefix`): the prefix's
    routes, then its own."""
    head = encoded.prefix_tokens
    if not 0 < head < num_tokens or prefix.prefix is not None:
        raise CorruptShard(f"a prefix of {head} tokens in a segment of {num_tokens}")
    own = dataclasses.replace(encoded, prefix=None, prefix_tokens=0)
    return Routes.concat(
        [
            decode(prefix, spec, head, dictionary),
            decode(own, spec, num_tokens - head, dictionary),
        ]
    )


def _unsort(
    ids: npt.NDArray[Any], order_z: bytes | None, spec: RouteSpec, num_tokens: int
) -> npt.NDArray[Any]:
    """Sorted ids (flat, layer-major) back in the producer's slot order, as the order
    stream `order_z` holds it."""
    if order_z is None:
        raise CorruptShard("an ordered spec's row has no order stream")
    layers, k = spec.num_layers, spec.top_k
    cells = layers * num_tokens
    if k <= LEHMER_MAX_K:
        ranks_raw = _unzstd(order_z, cells * 2, "order")
        order = np.frombuffer(ranks_raw, dtype=np.uint16)
        if int(order.max(initial=0)) >= math.factorial(k):
            raise CorruptShard("order stream holds a rank past k!")
    else:
        order = np.frombuffer(_unzstd(order_z, cells * k, "order"), dtype=np.uint8)
        order = order.reshape(cells, k)
    table = _rows_of(lehmer_table(k)) if k <= LEHMER_MAX_K else None
    sets = ids.reshape(cells * k)
    out = np.empty_like(sets)
    step = max(1, min(cells, UNSORT_CELLS))
    base = np.arange(0, step * k, k, dtype=np.intp)[:, None]
    index = np.empty((step, k), np.intp)  # reused: the gathers' indexes stay in cache
    for begin in range(0, cells, step):
        n = min(cells, begin + step) - begin
        part = order[begin : begin + n]
        if table is None and not_permutations(part).any():
            raise CorruptShard("order stream holds positions that are not a permutation")
        perm = part if table is None else np.take(table, part).view(np.uint8).reshape(n, k)
        np.add(perm, base[:n], out=index[:n])
        flat = slice(begin * k, (begin + n) * k)
        # in range by construction (each row of `perm` a permutation of 0..K-1): "clip"
        # spares numpy's bounds check, which would buffer `out`
        np.take(sets[flat], index[:n].reshape(-1), out=out[flat], mode="clip")
    return out


def not_permutations(positions: npt.NDArray[Any]) -> npt.NDArray[np.bool_]:
    """`[n]`: which rows of slot positions `[n, K]` are not a permutation of 0..K-1."""
    k = positions.shape[1]
    wrong: npt.NDArray[np.bool_] = (np.sort(positions, axis=1) != np.arange(k)).any(axis=1)
    return wrong


def _rows_of(table: npt.NDArray[np.uint8]) -> npt.NDArray[Any]:
    """A `[n, k]` uint8 table as `n` values of k bytes each: one gather takes a row."""
    words = row_words(table)
    if words is not None:
        return words
    return np.ascontiguousarray(table).view(np.dtype((np.void, table.shape[1]))).reshape(-1)
