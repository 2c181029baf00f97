"""Route streams a client encoded itself: accepted only when they decode, exactly, to
routes in canonical form, and digested as if the server had encoded them.

A rollout worker can run `codec.encode` (it has idle CPU) and upload the streams
instead of ids: the server then decodes and checks (several times cheaper than
validating and encoding) and stores the client's zstd frames as they came. Hostile
streams are refused before they cost much: each frame must declare its decompressed
size, which must be exactly what the spec and token count imply (at most
`MAX_ROW_BYTES` of ids per segment), and hold one frame and nothing after it.

Canonical form (docs/format.md, "Route streams"): per token-layer, the chosen experts
first, ascending, below `num_experts`, then zeros; counts absent when every count is K,
else at most K (K or 0 without `allow_fewer`); for ordered specs an order that is a
permutation keeping empty slots last. The ids stream's layout is undone by its
transform (`r3store.transforms`) before the rules are checked.

`SentStreams`, what a client sends, is a value of the vocabulary
(`r3store.route_types`), importable from here too.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import numpy.typing as npt
import zstandard

from r3store.errors import InvalidInput, InvalidRoutes
from r3store.logic import codec
from r3store.logic.codec import LEHMER_MAX_K, lehmer_table, not_permutations
from r3store.logic.routes import CHUNK_VALUES
from r3store.logic.stats import Counts, expert_load
from r3store.route_types import Dictionary, EncodedRoutes, Routes
from r3store.route_types import SentStreams as SentStreams
from r3store.spec import RouteSpec
from r3store.transforms import TRANSFORMS, RouteTransform

MAX_ROW_BYTES = 64 << 20  # decompressed ids of one segment; longer ones: send segments
MAX_UPLOAD_BYTES = 256 << 20  # decompressed ids of all encoded segments of one upload
CHECK_COST = 3  # memory checking a segment holds, per byte of its decompressed ids


def decoded_bytes(spec: RouteSpec, num_tokens: int) -> int:
    """The ids a segment of `num_tokens` tokens decodes to, in bytes."""
    return spec.num_layers * num_tokens * spec.top_k * spec.id_dtype.itemsize


def checking_bytes(spec: RouteSpec, num_tokens: int) -> int:
    """The most memory checking one encoded segment of `num_tokens` tokens holds at
    once (`accept`: the decompressed ids, a copy to undo deltas or the token-major
    transpose, counts, order and the load count; measured at 2.4x the ids for
    48 layers, 8 of 128, with `tracemalloc`), so that it is charged before anything is
    decompressed: `CHECK_COST` times `decoded_bytes`, of at most `MAX_ROW_BYTES` (a
    longer segment is refused before anything is decompressed)."""
    return CHECK_COST * min(decoded_bytes(spec, num_tokens), MAX_ROW_BYTES)


def fits(spec: RouteSpec, num_tokens: int) -> bool:
    """Whether a segment may be sent encoded (else: as ids, or in shorter segments)."""
    return decoded_bytes(spec, num_tokens) <= MAX_ROW_BYTES


def _exact(
    blob: bytes, expected: int, what: str, where: str, dictionary: Dictionary | None = None
) -> bytes:
    """The one zstd frame of `blob`, declaring and holding exactly `expected` bytes
    (compressed with `dictionary`, when given)."""
    try:
        declared = zstandard.frame_content_size(blob)
    except zstandard.ZstdError:
        raise InvalidRoutes(f"{where}: the {what} stream is not a zstd frame") from None
    if declared != expected:
        shown = "no size" if declared < 0 else f"{declared} bytes"
        raise InvalidRoutes(
            f"{where}: the {what} stream's frame declares {shown}; the spec and token count "
            f"make it {expected} bytes"
        )
    try:  # the output is bounded as it is made: a frame that lies about its size stops here
        decompressor = (
            zstandard.ZstdDecompressor() if dictionary is None else codec.decompressor(dictionary)
        )
        data = decompressor.decompress(blob, max_output_size=expected, allow_extra_data=False)
    except zstandard.ZstdError as exc:
        raise InvalidRoutes(
            f"{where}: the {what} stream is not one zstd frame of {expected} bytes: {exc}"
        ) from None
    if len(data) != expected:
        raise InvalidRoutes(f"{where}: the {what} stream holds {len(data)} bytes, not {expected}")
    return data


def _position(flat: int, num_tokens: int) -> str:
    layer, token = divmod(flat, num_tokens)
    return f"token {token}, layer {layer}"


def _first(
    bad: npt.NDArray[np.bool_],
    rows: npt.NDArray[np.intp] | int,
    num_tokens: int,
    where: str,
    why: str,
) -> None:
    """Raise naming the first row where `bad` holds: `rows` are the flat token-layer
    indices of `bad`'s rows, or the first of them when they follow one another."""
    if bad.any():
        first = int(np.flatnonzero(bad.reshape(bad.shape[0], -1).any(axis=1))[0])
        flat = rows + first if isinstance(rows, int) else int(rows[first])
        raise InvalidRoutes(f"{where}: {_position(flat, num_tokens)}: {why}")


def _check_rows(
    ids: npt.NDArray[Any],
    counts: npt.NDArray[np.uint8],
    rows: npt.NDArray[np.intp],
    spec: RouteSpec,
    num_tokens: int,
    where: str,
) -> None:
    """Every rule, slot by slot, on the token-layers `rows` (`ids` `[n, K]`)."""
    k = spec.top_k
    _first(counts > k, rows, num_tokens, where, f"a count above top_k {k}")
    if not spec.allow_fewer:
        wrong = (counts != 0) & (counts != k)
        _first(
            wrong,
            rows,
            num_tokens,
            where,
            f"fewer than top_k {k} experts, and the namespace does not allow_fewer",
        )
    chosen = np.arange(k, dtype=np.uint8) < counts[:, None]
    too_big = chosen & (ids >= spec.num_experts)
    _first(too_big, rows, num_tokens, where, f"an expert id >= num_experts {spec.num_experts}")
    _first(~chosen & (ids != 0), rows, num_tokens, where, "an empty slot that is not 0")
    if k > 1:
        rising = ids[:, 1:] > ids[:, :-1]
        _first(
            chosen[:, 1:] & ~rising,
            rows,
            num_tokens,
            where,
            "chosen experts not strictly ascending (repeated, or not sorted)",
        )


def _check_sets(
    ids: npt.NDArray[Any],
    counts: npt.NDArray[np.uint8] | None,
    offset: int,
    spec: RouteSpec,
    num_tokens: int,
    where: str,
) -> None:
    """`ids` `[n, K]` sorted sets of token-layers `offset ..`, `counts` `[n]` (None: all
    K). Full rows all at once, on the flat values (each value against the next, the
    largest against `num_experts`); slot by slot the rows with fewer than K, and every
    row when a full one breaks a rule (to name the first)."""
    k = spec.top_k
    n = ids.shape[0]
    partial = np.flatnonzero(counts != k) if counts is not None else np.empty(0, np.intp)
    if _full_rows_hold(ids, partial, spec):
        look = partial
    else:
        full = np.ones(n, bool) if counts is None else counts == k
        ok = full.copy()
        for j in range(k - 1):  # slot planes: a few vector operations, no [n, K] temporaries
            ok &= ids[:, j + 1] > ids[:, j]
        ok &= ids.max(axis=1) < spec.num_experts
        look = np.flatnonzero(~ok)  # rows with fewer than K, and full rows that break a rule
    if look.size:
        held = np.full(look.size, k, np.uint8) if counts is None else counts[look]
        _check_rows(ids[look], held, look + offset, spec, num_tokens, where)


def _full_rows_hold(ids: npt.NDArray[Any], partial: npt.NDArray[np.intp], spec: RouteSpec) -> bool:
    """Whether every row of `ids` `[n, K]` but those `partial` is strictly ascending,
    and every value below `num_experts` (a partial row's chosen experts are, and its
    empty slots hold 0, or `_check_rows` refuses it)."""
    k = spec.top_k
    flat = np.ascontiguousarray(ids).reshape(-1)
    if flat.size and int(flat.max()) >= spec.num_experts:
        return False
    if k == 1 or not flat.size:
        return True
    rising = np.empty(flat.size, bool)
    np.greater(flat[1:], flat[:-1], out=rising[:-1])
    rising[k - 1 :: k] = True  # a row's last value is not compared with the next row's
    if partial.size:
        rising[(partial[:, None] * k + np.arange(k - 1)).reshape(-1)] = True
    return bool(rising.all())


def _check_order(
    order: npt.NDArray[Any],
    counts: npt.NDArray[np.uint8],
    offset: int,
    spec: RouteSpec,
    num_tokens: int,
    where: str,
) -> None:
    """Ranks `[n]` (K <= 8) or positions `[n, K]`: a permutation, empty slots last. A
    rank below K! always names a permutation, so only rows with empty slots need
    theirs made."""
    k = spec.top_k
    if k <= LEHMER_MAX_K:
        _first(order >= math.factorial(k), offset, num_tokens, where, f"an order rank >= {k}!")
    else:
        _first(
            not_permutations(order),
            offset,
            num_tokens,
            where,
            "an order that is not a permutation of the slots",
        )
    partial = np.flatnonzero(counts < k)
    if not partial.size:
        return
    perm = lehmer_table(k)[order[partial]] if k <= LEHMER_MAX_K else order[partial]
    empty = np.arange(k, dtype=np.uint8) >= counts[partial, None]
    _first(
        empty & (perm != np.arange(k)),
        partial + offset,
        num_tokens,
        where,
        "an order that does not keep empty slots last",
    )


def accept(
    sent: SentStreams,
    spec: RouteSpec,
    num_tokens: int,
    salt: bytes,
    token_ids: npt.NDArray[np.int32] | None,
    where: str,
    dictionary: Dictionary | None = None,
) -> tuple[EncodedRoutes, Counts]:
    """Check `sent` against `spec` and return what to store (the client's frames, and
    the digest `codec.encode` would give the same routes) and the expert load of the
    routes (`r3store.logic.stats.expert_load`). Raises `InvalidRoutes`. Sent `tokens`
    (a frame holding exactly `num_tokens` ids in [0, 2**31)) are stored as sent;
    `token_ids` must then be None. An ids stream that names a dictionary is
    decompressed with `dictionary`, which must be that one; token-major ids
    (`Transform.TOKEN_MAJOR`) are checked as the layer-major ids they hold."""
    layers, k = spec.num_layers, spec.top_k
    if not fits(spec, num_tokens):
        raise InvalidRoutes(
            f"{where}: {num_tokens} tokens of encoded routes decode to more than "
            f"{MAX_ROW_BYTES >> 20} MiB: send them as segments, or as ids"
        )
    if sent.tokens is not None:
        if token_ids is not None:
            raise InvalidInput(f"{where}: token ids given twice (as ids and as a stream)")
        token_ids = _sent_tokens(sent.tokens, num_tokens, where)
    transform = _transform(sent, spec, dictionary, where)
    cells = layers * num_tokens
    used = None if sent.dictionary is None else dictionary
    raw = _exact(sent.ids, cells * k * spec.id_dtype.itemsize, "ids", where, used)
    ids = transform.inverse(np.frombuffer(raw, spec.id_dtype), (layers, num_tokens, k))
    counts = None
    if sent.counts is not None:
        counts = np.frombuffer(_exact(sent.counts, cells, "counts", where), np.uint8)
    order = None if sent.order is None else _sent_order(sent.order, spec, cells, where)
    _check_all(ids.reshape(cells, k), counts, order, spec, num_tokens, where)
    full = counts is None or bool((counts == k).all())
    order_raw = b"" if order is None else order.reshape(-1).view(np.uint8).data
    tokens_raw = b"" if token_ids is None else token_ids.astype("<i4").tobytes()
    counts_raw = b"" if full or counts is None else counts.tobytes()
    shape = (layers, num_tokens, k)
    sets_counts = None if full or counts is None else counts.reshape(layers, num_tokens)
    load = expert_load(Routes(ids.reshape(shape), sets_counts), spec)
    return EncodedRoutes(
        ids=sent.ids,
        counts=None if full else sent.counts,
        order=sent.order,
        transform=transform.id,
        digest=codec.content_digest(spec, ids, shape, counts_raw, order_raw, tokens_raw, salt),
        tokens=sent.tokens if sent.tokens is not None else codec.compress_tokens(token_ids),
        dictionary=sent.dictionary,
    ), load


def _sent_tokens(blob: bytes, num_tokens: int, where: str) -> npt.NDArray[Any]:
    """The token ids of a `tokens` stream: exactly `num_tokens`, in [0, 2**31)."""
    token_ids = np.frombuffer(_exact(blob, num_tokens * 4, "tokens", where), "<i4")
    if token_ids.size and int(token_ids.min()) < 0:
        raise InvalidRoutes(f"{where}: token ids must be in [0, 2**31)")
    return token_ids


def _transform(
    sent: SentStreams, spec: RouteSpec, dictionary: Dictionary | None, where: str
) -> RouteTransform:
    """The transform of the ids stream, once it is known, the dictionary it names the
    one given, and an order stream there exactly when the spec keeps the order."""
    transform = TRANSFORMS.get(sent.transform)
    if transform is None:
        raise InvalidRoutes(f"{where}: unknown route transform {sent.transform}")
    if sent.dictionary is not None and (dictionary is None or dictionary.digest != sent.dictionary):
        raise InvalidRoutes(
            f"{where}: the ids stream names dictionary {sent.dictionary.hex()}, which the "
            "namespace does not have"
        )
    if spec.ordered != (sent.order is not None):
        need = "needs an order stream" if spec.ordered else "takes no order stream"
        raise InvalidRoutes(f"{where}: the namespace {need}")
    return transform


def _sent_order(blob: bytes, spec: RouteSpec, cells: int, where: str) -> npt.NDArray[Any]:
    """The order stream of `cells` token-layers: ranks `[cells]` uint16 (K <= 8) or
    positions `[cells, K]` uint8."""
    k = spec.top_k
    if k <= LEHMER_MAX_K:
        return np.frombuffer(_exact(blob, cells * 2, "order", where), np.uint16)
    order = np.frombuffer(_exact(blob, cells * k, "order", where), np.uint8)
    return order.reshape(cells, k)


def _check_all(
    sets: npt.NDArray[Any],
    counts: npt.NDArray[np.uint8] | None,
    order: npt.NDArray[Any] | None,
    spec: RouteSpec,
    num_tokens: int,
    where: str,
) -> None:
    """Every rule on the sorted sets `[cells, K]`, their counts and order, a chunk of
    token-layers at a time."""
    k = spec.top_k
    cells = sets.shape[0]
    step = max(1, CHUNK_VALUES // k)
    for begin in range(0, cells, step):
        end = min(cells, begin + step)
        part = None if counts is None else counts[begin:end]
        _check_sets(sets[begin:end], part, begin, spec, num_tokens, where)
        if order is not None:
            held = np.full(end - begin, k, np.uint8) if part is None else part
            _check_order(order[begin:end], held, begin, spec, num_tokens, where)
