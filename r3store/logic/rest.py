"""Compression at rest: what maintenance does to cold rows, as pure functions.

Ingest compresses each trajectory alone and fast (zstd level 3 or 1). Cold rows are
encoded again (`settle`):

- with the namespace's zstd dictionary for their policy version (`train`: trained from
  the token-major sorted ids of that version's first cold trajectories), at a higher
  level (`REST_LEVEL`, chosen by bytes saved per CPU second in `bench/rest_bench.py`),
  each way of laying out the ids stream tried whole and the smallest kept
  (`codec.EVERY_TRANSFORM`);
- with the routes of a prompt stored once per GRPO group: samples of one group whose
  first `prompt_len` tokens carry byte-equal routes (counts and slot order included)
  share one prefix row; a sample whose prompt routes differ keeps its own.

Every row is decoded again from its new streams and compared with what it held before
(`Routes.equals`) before it may replace the old one. A row's digest, token ids and
metadata do not change. No I/O: the caller reads shards and dictionaries and writes the
results.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import zstandard

from r3store.errors import CorruptShard
from r3store.logic import codec
from r3store.route_types import Dictionary, EncodedRoutes, Routes
from r3store.spec import RouteSpec

REST_LEVEL = 6  # bench/rest_bench.py: past 6, a CPU second more saves several times less
DICTIONARY_BYTES = 256 << 10
MIN_SAMPLE_BYTES = 1 << 20  # of raw ids: less trains no dictionary worth its size
MAX_SAMPLE_BYTES = 32 << 20  # more takes longer and gains little
MIN_PREFIX_TOKENS = 16
SAMPLE_TOKENS = 512
PREFIX_SALT = b"r3store.prefix"
Samples = list[bytes | bytearray | memoryview]


@dataclass(frozen=True)
class ColdRow:
    """A stored segment's routes, decoded, with what identifies it."""

    routes: Routes
    stored: EncodedRoutes  # as it was stored (its digest, token ids)
    group_id: str | None
    source: str
    start: int
    prompt_len: int


def samples(spec: RouteSpec, rows: Sequence[ColdRow]) -> Samples:
    """Training samples: the ids stream's content as stored at rest (sorted ids,
    token-major), `SAMPLE_TOKENS` tokens of a trajectory each, until `MAX_SAMPLE_BYTES`.
    A GRPO group's prompt is taken once (from its first sample), as it will be stored:
    a dictionary that learnt the prompts would be spent on what sharing already saves."""
    out: Samples = []
    total = 0
    seen: set[tuple[str, str]] = set()
    for row in rows:
        first = 0
        if row.group_id is not None and row.start == 0:
            if (row.group_id, row.source) in seen:
                first = min(row.prompt_len, row.routes.num_tokens - 1)
            seen.add((row.group_id, row.source))
        ids = codec.sorted_ids(row.routes, spec)
        for begin in range(first, row.routes.num_tokens, SAMPLE_TOKENS):
            part = np.ascontiguousarray(ids[:, begin : begin + SAMPLE_TOKENS].transpose(1, 0, 2))
            out.append(part.tobytes())
            total += part.nbytes
            if total >= MAX_SAMPLE_BYTES:
                return out
    return out


def train(
    chunks: list[bytes | bytearray | memoryview], size: int = DICTIONARY_BYTES
) -> Dictionary | None:
    """A dictionary trained on `chunks`, or None when they are too few to be worth one."""
    if sum(len(c) for c in chunks) < MIN_SAMPLE_BYTES or len(chunks) < 8:
        return None
    try:
        trained = zstandard.train_dictionary(size, chunks, level=REST_LEVEL, k=1024, d=8)
    except zstandard.ZstdError:  # samples zstd cannot learn from (too uniform, too few)
        return None
    dictionary = Dictionary.of(trained.as_bytes())
    # worth keeping only if it saves more than its own size on what it learned from
    # (measured at level 3: cheap, and in the same direction as higher levels)
    plain, trained_with = zstandard.ZstdCompressor(level=3), codec.compressor(3, dictionary)
    saved = sum(len(plain.compress(c)) - len(trained_with.compress(c)) for c in chunks)
    return dictionary if saved > len(dictionary.data) else None


def _slice(routes: Routes, begin: int, end: int | None = None) -> Routes:
    counts = routes.layer_counts
    return Routes(
        np.ascontiguousarray(routes.layers[:, begin:end]),
        None if counts is None else np.ascontiguousarray(counts[:, begin:end]),
    )


def _encode(
    routes: Routes,
    spec: RouteSpec,
    dictionary: Dictionary | None,
    level: int,
    salt: bytes | None = None,
) -> EncodedRoutes:
    """Streams at rest, every layout tried; digested (with `salt`) only for a prefix:
    a row keeps the digest it was stored with."""
    return codec.encode(
        routes,
        spec,
        level,
        salt=salt or b"",
        digest=salt is not None,
        dictionary=dictionary,
        transforms=codec.EVERY_TRANSFORM,
    )


def _shared_prefix(rows: Sequence[ColdRow]) -> tuple[int, list[int]]:
    """The prefix length rows of one group may share, and which of them carry the
    routes most of them carry there, byte for byte (of equally many, the earliest's)."""
    length = min(r.prompt_len for r in rows)
    length = min(length, *(r.routes.num_tokens - 1 for r in rows))
    if length < MIN_PREFIX_TOKENS:
        return 0, []
    heads = [_slice(r.routes, 0, length) for r in rows]
    keys = [  # of what `equals` compares (`settle` checks every row decodes to its own)
        hashlib.sha256(h.to_topk().tobytes() + h.counts.tobytes()).digest() for h in heads
    ]
    members: dict[bytes, list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    return length, max(members.values(), key=len)  # the first of the largest, in order


def settle(
    spec: RouteSpec,
    rows: Sequence[ColdRow],
    dictionary: Dictionary | None,
    level: int = REST_LEVEL,
) -> list[EncodedRoutes]:
    """The rows' streams at rest, in the order given: each checked to decode to the
    routes it held."""
    out: list[EncodedRoutes | None] = [None] * len(rows)
    groups: dict[tuple[str, str], list[int]] = defaultdict(list)
    for i, row in enumerate(rows):
        if row.group_id is not None and row.start == 0 and row.prompt_len > 0:
            groups[(row.group_id, row.source)].append(i)
    for members in groups.values():
        if len(members) < 2:
            continue
        length, same = _shared_prefix([rows[i] for i in members])
        if len(same) < 2:
            continue
        head = _slice(rows[members[same[0]]].routes, 0, length)
        prefix = _encode(head, spec, dictionary, level, salt=PREFIX_SALT)
        for j in same:
            row = rows[members[j]]
            own = _encode(_slice(row.routes, length), spec, dictionary, level)
            out[members[j]] = dataclasses.replace(
                own,
                digest=row.stored.digest,
                tokens=row.stored.tokens,
                prefix=prefix,
                prefix_tokens=length,
            )
    for i, row in enumerate(rows):
        if out[i] is None:
            own = _encode(row.routes, spec, dictionary, level)
            out[i] = dataclasses.replace(own, digest=row.stored.digest, tokens=row.stored.tokens)
    settled = [e for e in out if e is not None]
    for row, encoded in zip(rows, settled, strict=True):
        again = codec.decode(encoded, spec, row.routes.num_tokens, dictionary)
        if not again.equals(row.routes):
            raise CorruptShard("a row encoded at rest does not decode to the routes it held")
    return settled
