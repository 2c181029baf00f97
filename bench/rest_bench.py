"""Compression at rest on routes of trained MoEs (`bench/corpus.py`), beside whole-corpus
baselines measured in the same run; uniform routes against the entropy bound; GRPO
groups with and without prompt sharing; the zstd level chosen by bytes saved per CPU
second; encode and decode speed; and a look at the order stream.

Bytes at rest are what the catalog counts after one maintenance pass (every stream of
every row, prefixes once) plus the dictionaries' own bytes.
"""

from __future__ import annotations

import dataclasses
import math
import tempfile
import time
from collections.abc import Callable
from math import comb, log2
from pathlib import Path

import numpy as np
import zstandard

from bench import corpus
from bench.figures import Figure, median_of, timed
from r3store.engine import Engine
from r3store.engine.maintenance import MaintenanceOptions
from r3store.engine.reader import ReaderConfig, plan_ranges
from r3store.logic import codec, rest
from r3store.logic.routes import Routes, from_topk, to_mask
from r3store.logic.writes import encode_write
from r3store.protocol.direct import pack
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.dictionary import read_dictionary
from r3store.storage.keys import DICTIONARY_PREFIX, SHARD_PREFIX, parse_dictionary_key
from r3store.storage.store import LocalStore
from r3store.testing.synthetic import uniform_topk

BYTES = "B/token-layer"
RATE = "M token-layers/s"
LEVELS = (3, 6, 9, 12, 15, 19)


def _zstd(data: bytes, level: int) -> int:
    params = zstandard.ZstdCompressionParameters.from_level(
        level, source_size=len(data), threads=-1, enable_ldm=level >= 19
    )
    return len(zstandard.ZstdCompressor(compression_params=params).compress(data))


def _token_layers(trajectories: list[np.ndarray]) -> int:
    return sum(t.shape[0] * t.shape[1] for t in trajectories)


def baselines(spec: RouteSpec, trajectories: list[np.ndarray]) -> dict[str, float]:
    """Whole-corpus figures, per token-layer: sorted ids (layer-major as stored, and
    token-major) at zstd 3 and 19, bit-packed masks (token-major) at zstd 3."""
    n = _token_layers(trajectories)
    ids = [np.sort(t, axis=-1).astype(spec.id_dtype) for t in trajectories]  # [L, T, K]
    layer_major = b"".join(t.tobytes() for t in ids)
    token_major = b"".join(np.ascontiguousarray(t.transpose(1, 0, 2)).tobytes() for t in ids)
    masks = b"".join(
        to_mask(from_topk(t.transpose(1, 0, 2), spec, t.shape[1]), spec).tobytes()
        for t in trajectories
    )
    return {
        "zstd-3": min(_zstd(layer_major, 3), _zstd(token_major, 3)) / n,
        "zstd-19": min(_zstd(layer_major, 19), _zstd(token_major, 19)) / n,
        "masks zstd-3": _zstd(masks, 3) / n,
    }


def _writes(
    trajectories: list[np.ndarray], groups: list[tuple[str, int]] | None = None
) -> list[TrajectoryWrite]:
    return [
        TrajectoryWrite(
            f"t{i}",
            t.shape[1],
            topk=t.transpose(1, 0, 2),
            group_id=None if groups is None else groups[i][0],
            prompt_len=0 if groups is None else groups[i][1],
        )
        for i, t in enumerate(trajectories)
    ]


def at_rest(
    spec: RouteSpec,
    writes: list[TrajectoryWrite],
    puts: int = 16,
    earlier: list[TrajectoryWrite] | None = None,
    **options: object,
) -> tuple[int, int, int, int]:
    """Bytes as ingest stored them, bytes at rest (dictionaries trained for them
    included), ranged GETs of the costliest one-trajectory read, and dictionaries
    trained. `earlier`: traffic of the same policy version put and settled first (its
    dictionary is what `writes` then use); its bytes are not counted."""
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "o")
        with Engine(store, Catalog(f"sqlite:///{tmp}/c.db")) as engine:
            engine.namespaces.create("ns", spec)

            def settled(batch: list[TrajectoryWrite]) -> tuple[int, int, int]:
                step = max(1, math.ceil(len(batch) / puts))
                for begin in range(0, len(batch), step):
                    engine.put("ns", batch[begin : begin + step])
                ingest = engine.namespaces.usage("ns").live_route_bytes
                report = engine.upkeep.maintenance(
                    MaintenanceOptions(cold_seconds=0, **options)
                ).run()
                stored = engine.namespaces.usage("ns").live_route_bytes
                stored += sum(o.size for o in store.list(DICTIONARY_PREFIX))
                return ingest, stored, report.dictionaries_trained

            _ingest, before, _trained = settled(earlier or [])
            ingest, stored, trained = settled(writes)
            engine.flush()
        config, catalog = ReaderConfig(), Catalog(f"sqlite:///{tmp}/c.db")
        found = catalog.segments.lookup("ns", [w.trajectory_id for w in writes])
        catalog.close()
        gets = max(
            len(plan_ranges(e.spans.spans, config.coalesce_bytes, config.gap_bytes))
            for entries in found.values()
            for e in entries
        )
    return ingest - before, stored - before, gets, trained


def direct_bytes(spec: RouteSpec, writes: list[TrajectoryWrite]) -> tuple[int, int, int]:
    """Bytes a rollout worker uploads in direct writes of the second half of `writes`
    without a dictionary and once the first half made one (compression at rest
    trained it: the write plan hands it out), and the bytes that second half takes at
    rest (its dictionaries included), side by side."""
    half = len(writes) // 2
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "o")
        with Engine(store, Catalog(f"sqlite:///{tmp}/c.db")) as engine:
            engine.namespaces.create("ns", spec)
            for begin in range(0, half, 16):
                engine.put("ns", writes[begin : min(begin + 16, half)])
            engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run()
            found = [parse_dictionary_key(o.key) for o in store.list(DICTIONARY_PREFIX)]
            [(namespace, digest)] = [d for d in found if d is not None]
            dictionary = read_dictionary(store, namespace, digest)
            second = writes[half:]
            plain, _ = pack([encode_write(w, spec) for w in second])
            encoded = [encode_write(w, spec, dictionary) for w in second]
            blob, _ = pack(encoded)
            before = engine.namespaces.usage("ns").live_route_bytes
            dictionaries = sum(o.size for o in store.list(DICTIONARY_PREFIX))
            for begin in range(0, len(encoded), 16):
                engine.put("ns", encoded[begin : begin + 16])
            engine.upkeep.maintenance(MaintenanceOptions(cold_seconds=0)).run()
            stored = engine.namespaces.usage("ns").live_route_bytes - before
            stored += sum(o.size for o in store.list(DICTIONARY_PREFIX)) - dictionaries
    return len(plain), len(blob), stored


def _direct(spec: RouteSpec, label: str, writes: list[TrajectoryWrite], n: int) -> list[Figure]:
    plain, with_dictionary, stored = direct_bytes(spec, writes)
    return [
        Figure(
            f"{label}: direct writes with the namespace dictionary vs at rest",
            with_dictionary / n,
            BYTES,
            stored / n,
            "the same rows at rest",
            "<= 1.2x",
        ),
        Figure(
            f"{label}: direct writes without a dictionary vs at rest",
            plain / n,
            BYTES,
            stored / n,
            "the same rows at rest",
        ),
    ]


def _cold(spec: RouteSpec, trajectories: list[np.ndarray]) -> list[rest.ColdRow]:
    return [
        rest.ColdRow(routes, codec.encode(routes, spec), None, "engine", 0, 0)
        for routes in (from_topk(t.transpose(1, 0, 2), spec, t.shape[1]) for t in trajectories)
    ]


def _at_rest(
    spec: RouteSpec, dictionary: codec.Dictionary | None, level: int
) -> Callable[[Routes], codec.EncodedRoutes]:
    return lambda r: codec.encode(
        r, spec, level, dictionary=dictionary, transforms=codec.EVERY_TRANSFORM
    )


def _levels(spec: RouteSpec, trajectories: list[np.ndarray]) -> list[Figure]:
    """Bytes saved over ingest per CPU second of encoding at rest, by level: overall,
    and what each level saves beyond the one before per CPU second more it costs."""
    cold = _cold(spec, trajectories[: max(8, len(trajectories) // 4)])
    routes = [c.routes for c in cold]
    dictionary = rest.train(rest.samples(spec, cold))
    ingest = sum(c.stored.nbytes for c in cold)
    n = sum(r.num_tokens for r in routes) * spec.num_layers
    name = f"rest {spec.num_layers}x{spec.num_experts}x{spec.top_k}"
    out, before = [], (ingest, 0.0)
    for level in LEVELS:
        encode = _at_rest(spec, dictionary, level)
        start = time.process_time()
        size = sum(encode(r).nbytes for r in routes)
        seconds = time.process_time() - start
        marginal = (before[0] - size) / max(seconds - before[1], 1e-3) / 1e6
        out += [
            Figure(f"{name}: level {level}, bytes", size / n, BYTES),
            Figure(
                f"{name}: level {level}, saved per CPU s", (ingest - size) / seconds / 1e6, "MB/s"
            ),
            Figure(
                f"{name}: level {level}, saved per CPU s more than the level before",
                marginal,
                "MB/s",
            ),
        ]
        before = (size, seconds)
    return out


def _speed(spec: RouteSpec, trajectories: list[np.ndarray]) -> list[Figure]:
    """Encode at ingest and at rest, decode of both, on one core."""
    cold = _cold(spec, trajectories[:16])
    routes = [c.routes for c in cold]
    n = sum(r.num_tokens for r in routes) * spec.num_layers
    dictionary = rest.train(rest.samples(spec, cold))
    ingest = [codec.encode(r, spec) for r in routes]
    at_rest_of = _at_rest(spec, dictionary, rest.REST_LEVEL)
    rested = [at_rest_of(r) for r in routes]
    name = f"rest {spec.num_layers}x{spec.num_experts}x{spec.top_k}"

    def rate(fn: Callable[[], object]) -> float:
        return n / median_of(3, lambda: timed(fn)) / 1e6

    return [
        Figure(
            f"{name}: encode at ingest, one core",
            rate(lambda: [codec.encode(r, spec) for r in routes]),
            RATE,
        ),
        Figure(
            f"{name}: encode at rest, one core", rate(lambda: [at_rest_of(r) for r in routes]), RATE
        ),
        Figure(
            f"{name}: decode ingest streams, one core",
            rate(
                lambda: [
                    codec.decode(e, spec, r.num_tokens) for e, r in zip(ingest, routes, strict=True)
                ]
            ),
            RATE,
        ),
        Figure(
            f"{name}: decode at rest, one core",
            rate(
                lambda: [
                    codec.decode(e, spec, r.num_tokens, dictionary)
                    for e, r in zip(rested, routes, strict=True)
                ]
            ),
            RATE,
        ),
    ]


def _prior_ranks(spec: RouteSpec, trajectories: list[np.ndarray]) -> list[np.ndarray]:
    """Lehmer ranks `[L, T]` of the second half's score orders relative to a predicted
    one: the chosen experts sorted by their mean slot in the first half, per layer."""
    layers, experts, k = spec.num_layers, spec.num_experts, spec.top_k
    half = len(trajectories) // 2
    slots, seen = np.zeros((layers, experts)), np.zeros((layers, experts))
    for t in trajectories[:half]:
        for layer in range(layers):
            for i in range(k):
                np.add.at(slots[layer], t[layer, :, i], i)
                np.add.at(seen[layer], t[layer, :, i], 1)
    prior = slots / np.maximum(seen, 1)
    out = []
    for t in trajectories[half:]:
        key = prior[np.arange(layers)[:, None, None], t]
        place = np.argsort(np.argsort(key, axis=-1, kind="stable"), axis=-1)
        out.append(codec._lehmer_rank([place[..., i].astype(np.uint16) for i in range(k)]))
    return out


def _order(spec: RouteSpec, trajectories: list[np.ndarray]) -> list[Figure]:
    """The order stream: stored bytes beside the empirical entropy of the Lehmer ranks
    (per layer) and the bound for a random order, log2(K!)/8; for K <= 5, ranks as
    uint8 token-major at the rest level, as they are and relative to a prediction."""
    ordered = RouteSpec(spec.num_layers, spec.num_experts, spec.top_k, ordered=True)
    stored, n, entropy = 0, 0, 0.0
    ranks_all: list[np.ndarray] = []
    for t in trajectories:
        routes = from_topk(t.transpose(1, 0, 2), ordered, t.shape[1])
        encoded = codec.encode(routes, ordered)
        stored += len(encoded.order or b"")
        n += t.shape[0] * t.shape[1]
        planes = [t[..., i].astype(np.uint16) for i in range(spec.top_k)]
        ranks_all.append(codec._lehmer_rank(planes))
    ranks = np.concatenate(ranks_all, axis=1)  # [L, tokens]
    for layer in ranks:
        _, counts = np.unique(layer, return_counts=True)
        p = counts / counts.sum()
        entropy += float(-(p * np.log2(p)).sum()) * layer.size
    name = f"order {spec.num_layers}x{spec.num_experts}x{spec.top_k}"
    bound = log2(math.factorial(spec.top_k)) / 8
    figures = [
        Figure(
            f"{name}: stored order stream vs random order", stored / n, BYTES, bound, "log2(K!)/8"
        ),
        Figure(
            f"{name}: rank entropy per layer vs random order",
            entropy / n / 8,
            BYTES,
            bound,
            "log2(K!)/8",
        ),
    ]
    if math.factorial(spec.top_k) <= 256:
        compressor = zstandard.ZstdCompressor(level=rest.REST_LEVEL)

        def packed(all_ranks: list[np.ndarray]) -> float:
            size = sum(len(compressor.compress(r.T.astype(np.uint8).tobytes())) for r in all_ranks)
            return size / sum(r.size for r in all_ranks)

        predicted = _prior_ranks(spec, trajectories)
        figures += [
            Figure(f"{name}: ranks as uint8", packed(ranks_all), BYTES, bound, "log2(K!)/8"),
            Figure(
                f"{name}: ranks as uint8, second half, vs the layer's expert prior",
                packed(predicted),
                BYTES,
                packed(ranks_all[len(trajectories) // 2 :]),
                "as they are",
            ),
        ]
    return figures


def _shape(name: str, quick: bool) -> list[Figure]:
    data = corpus.load(name)
    shape = data.shape
    spec = RouteSpec(shape.layers, shape.experts, shape.top_k)
    trajectories = data.trajectories[: 24 if quick else None]
    base = baselines(spec, trajectories)
    n = _token_layers(trajectories)
    writes = _writes(trajectories)
    ingest, stored, gets, _trained = at_rest(spec, writes)
    label = f"rest {name}"
    figures = [
        Figure(f"{label}: corpus tokens", n / shape.layers, "tokens"),
        Figure(f"{label}: whole corpus, sorted ids zstd-19", base["zstd-19"], BYTES),
        Figure(f"{label}: whole corpus, masks zstd-3", base["masks zstd-3"], BYTES),
        Figure(
            f"{label}: at ingest vs whole-corpus zstd-3",
            ingest / n,
            BYTES,
            base["zstd-3"],
            "zstd-3",
        ),
        Figure(
            f"{label}: at rest vs whole-corpus zstd-3",
            stored / n,
            BYTES,
            base["zstd-3"],
            "zstd-3",
            "<= 1.05x",
        ),
        Figure(f"{label}: ranged GETs per trajectory read", gets, "GETs", None, None, "1"),
    ]
    second = trajectories[len(trajectories) // 2 :]
    figures += _direct(spec, label, writes, _token_layers(second))
    figures += _levels(spec, trajectories)
    figures += _speed(spec, trajectories)
    figures += _order(spec, trajectories)
    return figures


def _uniform(quick: bool) -> list[Figure]:
    spec = RouteSpec(48, 128, 8)
    rng = np.random.default_rng(0)
    trajectories = [
        uniform_topk(rng, 1024, 48, 128, 8).transpose(1, 0, 2) for _ in range(4 if quick else 16)
    ]
    _ingest, stored, _gets, _trained = at_rest(spec, _writes(trajectories))
    bound = log2(comb(128, 8)) / 8
    return [
        Figure(
            "rest uniform 48x128x8: at rest vs entropy bound",
            stored / _token_layers(trajectories),
            BYTES,
            bound,
            "entropy",
            "<= 1.05x",
        )
    ]


def _grpo(quick: bool) -> list[Figure]:
    """GRPO groups stored with and without prompt sharing, after the same policy's
    earlier traffic (the shape's corpus) trained the dictionary both use: a dictionary
    trained on these few groups would hold their prompts themselves, which one trained
    on a version's first rows cannot do for the thousands of groups after them."""
    name = "8x64x4"
    groups = corpus.grpo(name, groups=4 if quick else 16, size=8, prompt_fraction=0.5)
    shape = corpus.SHAPES[name]
    spec = RouteSpec(shape.layers, shape.experts, shape.top_k)
    earlier = [
        dataclasses.replace(w, trajectory_id=f"earlier-{w.trajectory_id}")
        for w in _writes(corpus.load(name).trajectories[: 24 if quick else None])
    ]
    trajectories = [routes for group in groups for routes, _prompt in group]
    meta = [(f"g{g}", prompt) for g, group in enumerate(groups) for _routes, prompt in group]
    shared = at_rest(spec, _writes(trajectories, meta), earlier=earlier)[1]
    alone = at_rest(spec, _writes(trajectories), earlier=earlier)[1]  # no groups: no sharing
    return [
        Figure(
            f"rest GRPO {name}, groups of 8, prompts 50%: with vs without sharing",
            shared / _token_layers(trajectories),
            BYTES,
            alone / _token_layers(trajectories),
            "no sharing",
            "<= 0.60x",
        )
    ]


def _merging(quick: bool) -> list[Figure]:
    """64 puts of one trajectory each (64 shards), then one maintenance pass: the shard
    objects' bytes beyond the routes they hold, before and after."""
    name = "8x64x4"
    shape = corpus.SHAPES[name]
    spec = RouteSpec(shape.layers, shape.experts, shape.top_k)
    writes = _writes(corpus.load(name).trajectories[: 16 if quick else 64])
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        store = LocalStore(Path(tmp) / "o")
        with Engine(store, Catalog(f"sqlite:///{tmp}/c.db")) as engine:
            engine.namespaces.create("ns", spec)
            for write in writes:
                engine.put("ns", [write])
            for when in ("after ingest", "at rest"):
                if when == "at rest":
                    engine.upkeep.maintenance(
                        MaintenanceOptions(cold_seconds=0, grace_seconds=0)
                    ).run()
                routes = engine.namespaces.usage("ns").live_route_bytes
                objects = [o.size for o in store.list(SHARD_PREFIX)]
                out.append(
                    Figure(
                        f"rest {len(writes)} puts of one trajectory, {when}: "
                        f"{len(objects)} shards, bytes beyond the routes",
                        (sum(objects) - routes) / routes * 100,
                        "%",
                    )
                )
    return out


def run(quick: bool = False) -> list[Figure]:
    figures: list[Figure] = []
    for name in corpus.SHAPES:
        figures += _shape(name, quick)
    figures += _uniform(quick)
    figures += _grpo(quick)
    figures += _merging(quick)
    return figures
