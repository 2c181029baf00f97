"""Synthetic routes for tests and benchmarks, built the way engines emit them."""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt


def uniform_topk(
    rng: np.random.Generator, rows: int, layers: int, experts: int, k: int, dtype: Any = np.int32
) -> npt.NDArray[Any]:
    """Each token-layer picks k distinct experts uniformly at random, in random order."""
    if 4 * k > experts:
        scores = rng.random((rows, layers, experts), dtype=np.float32)
        top = np.argpartition(scores, experts - k, axis=-1)[..., experts - k :]
        return rng.permuted(top, axis=-1).astype(dtype)
    # draw k ids per token-layer and redraw the rows that repeat one: far faster
    ids = rng.integers(0, experts, (rows * layers, k), dtype=np.int32)
    redo = np.arange(ids.shape[0])
    while redo.size:
        ordered = np.sort(ids[redo], axis=-1)
        redo = redo[(ordered[:, 1:] == ordered[:, :-1]).any(axis=-1)]
        ids[redo] = rng.integers(0, experts, (redo.size, k), dtype=np.int32)
    return ids.reshape(rows, layers, k).astype(dtype)


def skewed_topk(
    rng: np.random.Generator,
    rows: int,
    layers: int,
    experts: int,
    k: int,
    skew: float = 1.2,
    stickiness: float = 0.5,
    dtype: Any = np.int32,
) -> npt.NDArray[Any]:
    """Routes with each layer's own expert popularity and correlated neighbouring tokens.

    Each layer draws log-popularities `skew * N(0, 1)`; a token-layer picks top-k by
    Gumbel noise over them (in descending score order, as routers emit), and with
    probability `stickiness` repeats the previous token's choice in that layer.
    """
    popularity = skew * rng.standard_normal((layers, experts)).astype(np.float32)
    gumbel = -np.log(-np.log(rng.random((rows, layers, experts), dtype=np.float32) + 1e-12) + 1e-12)
    scores = popularity[None] + gumbel
    top = np.argpartition(scores, experts - k, axis=-1)[..., experts - k :]
    top_scores = np.take_along_axis(scores, top, axis=-1)
    ranked = np.take_along_axis(top, np.argsort(-top_scores, axis=-1), axis=-1)
    fresh = rng.random((rows, layers)) >= stickiness
    fresh[0] = True
    source = np.where(fresh, np.arange(rows)[:, None], 0)
    np.maximum.accumulate(source, axis=0, out=source)
    out = np.take_along_axis(ranked, source[:, :, None], axis=0)
    return out.astype(dtype)


def drifting_topk(
    rng: np.random.Generator,
    rows: int,
    layers: int,
    experts: int,
    k: int,
    skew: float = 1.5,
    rho: float = 0.95,
    dtype: Any = np.int32,
) -> npt.NDArray[Any]:
    """Routes from router logits that drift slowly along the sequence.

    Logits are a per-layer popularity `skew * N(0, 1)` plus an AR(1) process over
    tokens with correlation `rho`; top-k in descending logit order. Neighbouring tokens
    share most experts without repeating sets exactly: harder for LZ than `skewed_topk`.
    """
    popularity = skew * rng.standard_normal((layers, experts)).astype(np.float32)
    noise = rng.standard_normal((rows, layers, experts), dtype=np.float32)
    scale = np.float32(np.sqrt(1 - rho * rho))
    for t in range(1, rows):
        noise[t] *= scale
        noise[t] += np.float32(rho) * noise[t - 1]
    scores = noise + popularity[None]
    top = np.argpartition(scores, experts - k, axis=-1)[..., experts - k :]
    top_scores = np.take_along_axis(scores, top, axis=-1)
    return np.take_along_axis(top, np.argsort(-top_scores, axis=-1), axis=-1).astype(dtype)


def decode_bomb(name: str, segments: int = 4) -> list[Any]:
    """`segments` writes of a 48-layer, 8-of-128 namespace whose encoded routes take
    a few kB and decode to 64 MiB each (experts 0 to 7 for every token-layer: valid, so
    checking them decodes every one in full): what an upload's memory charge is for."""
    import zstandard

    from r3store.logic.streams import MAX_ROW_BYTES
    from r3store.records import TrajectoryWrite
    from r3store.route_types import SentStreams

    tokens = MAX_ROW_BYTES // (48 * 8)
    ids = zstandard.ZstdCompressor(level=19).compress(bytes(range(8)) * (48 * tokens))
    sent = SentStreams(ids, 0)
    return [TrajectoryWrite(f"{name}-{i}", tokens, encoded=sent) for i in range(segments)]
