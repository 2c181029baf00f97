"""Bytes per token-layer of the storage encoding beside the entropy bound, int32 and masks,
and the codec's speed on one core."""

from __future__ import annotations

from collections.abc import Callable
from math import comb, factorial, log2
from typing import Any

import numpy as np
import zstandard

from bench.figures import Figure, median_of, timed
from r3store.logic import codec, streams
from r3store.logic.routes import from_topk, to_mask
from r3store.logic.writes import encode_write
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.synthetic import drifting_topk, skewed_topk, uniform_topk

LAYERS, EXPERTS, K = 48, 128, 8
RATE = "M token-layers/s"
BYTES = "B/token-layer"


def _zstd1(data: bytes) -> int:
    return len(zstandard.ZstdCompressor(level=1).compress(data))


def _mask_sizes(ids: np.ndarray, tokens: int) -> tuple[float, float]:
    """zstd-1 of bit-packed masks, token-major and layer-major, per token-layer."""
    spec = RouteSpec(LAYERS, EXPERTS, K)
    mask = to_mask(from_topk(ids, spec, tokens), spec)
    n = tokens * LAYERS
    token_major = _zstd1(mask.tobytes()) / n
    layer_major = _zstd1(np.ascontiguousarray(mask.transpose(1, 0, 2)).tobytes()) / n
    return token_major, layer_major


def _case(label: str, ids: np.ndarray, tokens: int, ordered: bool, speed: bool) -> list[Figure]:
    spec = RouteSpec(LAYERS, EXPERTS, K, ordered=ordered)
    n = tokens * LAYERS
    encoded = codec.encode(from_topk(ids, spec, tokens), spec)
    per = encoded.nbytes / n
    name = f"codec {label} {'ordered' if ordered else 'set'}"
    out = [Figure(f"{name}: bytes vs int32 ids", per, BYTES, 4.0 * K, "int32 as engines emit")]
    if label == "uniform":
        bound = log2(comb(EXPERTS, K)) / 8 + (log2(factorial(K)) / 8 if ordered else 0.0)
        target = "<= 7.56 B (5.56 + 2)" if ordered else "<= 5.56 B (1.10x)"
        out.append(Figure(f"{name}: bytes vs entropy bound", per, BYTES, bound, "entropy", target))
    else:
        token_major, layer_major = _mask_sizes(ids, tokens)
        target = None if ordered else "<= 1.0x"
        out.append(
            Figure(
                f"{name}: bytes vs zstd-1 masks, layer-major",
                per,
                BYTES,
                layer_major,
                "mask",
                target,
            )
        )
        out.append(
            Figure(
                f"{name}: bytes vs zstd-1 masks, token-major",
                per,
                BYTES,
                token_major,
                "mask",
                target,
            )
        )
    if speed:
        enc: Callable[[], Any] = lambda: codec.encode(from_topk(ids, spec, tokens), spec)  # noqa: E731
        dec: Callable[[], Any] = lambda: codec.decode(encoded, spec, tokens)  # noqa: E731
        out.append(
            Figure(
                f"{name}: validate+encode, one core",
                n / median_of(3, lambda: timed(enc)) / 1e6,
                RATE,
            )
        )
        out.append(
            Figure(f"{name}: decode, one core", n / median_of(3, lambda: timed(dec)) / 1e6, RATE)
        )
        out += _write_path(name, ids, spec, tokens)
    return out


def _write_path(name: str, ids: np.ndarray, spec: RouteSpec, tokens: int) -> list[Figure]:
    """A direct write's CPU per token-layer: the client encoding int32 engine output as
    `Client.put` does (`encode_write`), and the server checking what it sent
    (`streams.accept`: decode, every rule, digest, expert load)."""
    write = TrajectoryWrite("t", tokens, topk=ids.astype(np.int32))
    sent = encode_write(write, spec)
    encoded = sent.encoded
    assert encoded is not None
    n = tokens * LAYERS

    def check() -> object:
        return streams.accept(encoded, spec, tokens, b"", sent.tokens(), "t")

    client = median_of(3, lambda: timed(lambda: encode_write(write, spec)))
    server = median_of(3, lambda: timed(check))
    return [
        Figure(f"{name}: client encode of int32 engine output, one core", client / n * 1e9, "ns"),
        Figure(f"{name}: server check of client-encoded streams, one core", server / n * 1e9, "ns"),
    ]


def run(tokens: int = 4096) -> list[Figure]:
    rng = np.random.default_rng(0)
    figures: list[Figure] = []
    for label, generator, speed in (
        ("uniform", uniform_topk, True),
        ("skewed", skewed_topk, False),
        ("drifting", drifting_topk, True),
    ):
        ids = generator(rng, tokens, LAYERS, EXPERTS, K)
        for ordered in (False, True):
            figures += _case(label, ids, tokens, ordered, speed)
    return figures
