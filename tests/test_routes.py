"""Route validation and conversion, and the storage codec's round trips."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from math import factorial
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3store.errors import InvalidRoutes, InvalidSpec
from r3store.logic import codec
from r3store.logic.routes import EMPTY, from_mask, from_topk, sorting_network, to_mask
from r3store.spec import RouteSpec
from r3store.testing.synthetic import drifting_topk, skewed_topk, uniform_topk

EXPERTS = [8, 64, 128, 256, 384]


@st.composite
def routed(draw: st.DrawFn) -> tuple[RouteSpec, np.ndarray, int]:
    experts = draw(st.sampled_from(EXPERTS))
    k = draw(st.integers(1, min(16, experts)))  # past 8, ordered routes keep raw positions
    spec = RouteSpec(
        num_layers=draw(st.integers(1, 4)),
        num_experts=experts,
        top_k=k,
        ordered=draw(st.booleans()),
        allow_fewer=draw(st.booleans()),
    )
    num_tokens = draw(st.integers(1, 40))
    rows = num_tokens - draw(st.integers(0, 1))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dtype = draw(
        st.sampled_from(
            [np.int32, np.int64, np.int16] + ([np.uint8] if experts <= 256 else [np.uint16])
        )
    )
    ids = uniform_topk(rng, rows, spec.num_layers, experts, k, dtype=np.int64)
    if spec.allow_fewer and rows:
        drop = rng.random(ids.shape) < 0.3
        ids[drop] = EMPTY
    if rows:
        unrecorded = rng.random(ids.shape[:2]) < 0.1
        ids[unrecorded] = EMPTY
    if np.dtype(dtype).kind == "u":
        # unsigned dtypes cannot say -1: use full routes
        ids = uniform_topk(rng, rows, spec.num_layers, experts, k, dtype=np.int64)
    return spec, ids.astype(dtype), num_tokens


def expected_topk(spec: RouteSpec, ids: np.ndarray, num_tokens: int) -> np.ndarray:
    """What canonical routes should hold, computed with plain Python-level numpy."""
    wide = ids.astype(np.int64)
    out = np.full((num_tokens, spec.num_layers, spec.top_k), EMPTY, dtype=np.int64)
    for t in range(wide.shape[0]):
        for layer in range(spec.num_layers):
            chosen = [int(x) for x in wide[t, layer] if x != EMPTY]
            if not spec.ordered:
                chosen.sort()
            out[t, layer, : len(chosen)] = chosen
    return out


@settings(max_examples=300, deadline=None)
@given(routed())
def test_topk_round_trips_through_storage(case: tuple[RouteSpec, np.ndarray, int]) -> None:
    spec, ids, num_tokens = case
    routes = from_topk(ids, spec, num_tokens)
    want = expected_topk(spec, ids, num_tokens)
    assert np.array_equal(routes.to_topk(dtype=np.int64), want)
    for level in (1, 3):
        encoded = codec.encode(routes, spec, level)
        back = codec.decode(encoded, spec, num_tokens)
        assert np.array_equal(back.to_topk(dtype=np.int64), want)
        assert np.array_equal(back.counts, routes.counts)
    for transform in codec.EVERY_TRANSFORM:  # as maintenance may store them at rest
        encoded = codec.encode(routes, spec, 1, transforms=(transform,))
        one = spec.top_k == 1 and transform == codec.Transform.DELTA  # stored as ids
        assert encoded.transform == (codec.Transform.SORTED if one else transform)
        back = codec.decode(encoded, spec, num_tokens)
        assert np.array_equal(back.to_topk(dtype=np.int64), want)
        assert np.array_equal(back.counts, routes.counts)
        handed_out = codec.portable(encoded, spec, num_tokens, None)
        assert codec.self_contained(handed_out)
        assert handed_out.transform != codec.Transform.TOKEN_MAJOR
        back = codec.decode(handed_out, spec, num_tokens)
        assert np.array_equal(back.to_topk(dtype=np.int64), want)
    if num_tokens > ids.shape[0]:
        assert (routes.counts[-1] == 0).all(), "the engine's missing last row has no route"


@settings(max_examples=60, deadline=None)
@given(routed().filter(lambda case: case[0].top_k > 8), st.booleans())
def test_wide_top_k_round_trips(case: tuple[RouteSpec, np.ndarray, int], ordered: bool) -> None:
    """K > 8: the order of an ordered namespace is stored as raw positions, not ranks."""
    spec, ids, num_tokens = case
    spec = dataclasses.replace(spec, ordered=ordered)
    routes = from_topk(ids, spec, num_tokens)
    want = expected_topk(spec, ids, num_tokens)
    encoded = codec.encode(routes, spec)
    assert (encoded.order is not None) == ordered
    back = codec.decode(encoded, spec, num_tokens)
    assert np.array_equal(back.to_topk(dtype=np.int64), want)


@settings(max_examples=200, deadline=None)
@given(routed())
def test_masks_round_trip(case: tuple[RouteSpec, np.ndarray, int]) -> None:
    spec, ids, num_tokens = case
    set_spec = RouteSpec(spec.num_layers, spec.num_experts, spec.top_k, False, spec.allow_fewer)
    routes = from_topk(ids, set_spec, num_tokens)
    mask = to_mask(routes, set_spec)
    assert mask.shape == (num_tokens, spec.num_layers, (spec.num_experts + 7) // 8)
    # independent check: unpack and compare with the id sets
    bits = np.unpackbits(mask, axis=-1, bitorder="little")[..., : spec.num_experts]
    want = expected_topk(set_spec, ids, num_tokens)
    for t in range(num_tokens):
        for layer in range(spec.num_layers):
            assert set(np.flatnonzero(bits[t, layer])) == {int(x) for x in want[t, layer] if x >= 0}
    again = from_mask(mask, set_spec, num_tokens)
    assert again.equals(routes)
    back = codec.decode(codec.encode(again, set_spec), set_spec, num_tokens)
    assert np.array_equal(to_mask(back, set_spec), mask)


@pytest.mark.parametrize("n", range(1, 21))
def test_sorting_network_sorts_every_zero_one_input(n: int) -> None:
    # the 0-1 principle: a comparator network that sorts all 0-1 inputs sorts everything
    inputs = (
        ((np.arange(2**n)[:, None] >> np.arange(n)) & 1).astype(np.uint8)
        if n <= 14
        else (np.random.default_rng(n).integers(0, 2, (20000, n), dtype=np.uint8))
    )
    planes = [inputs[:, i].copy() for i in range(n)]
    for a, b in sorting_network(n):
        low = np.minimum(planes[a], planes[b])
        planes[b] = np.maximum(planes[a], planes[b])
        planes[a] = low
    assert np.array_equal(np.stack(planes, axis=1), np.sort(inputs, axis=1))


SPEC = RouteSpec(num_layers=3, num_experts=16, top_k=2)


def good_ids(rows: int = 5) -> np.ndarray:
    return uniform_topk(np.random.default_rng(0), rows, 3, 16, 2)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda a: a[:, :2], r"shape \[rows, 3, 2\], got \[5, 2, 2\]"),
        (lambda a: a.astype(np.float32), "must be integers"),
        (lambda a: np.concatenate([a, a[:1]]), "6 rows but the trajectory has 5 tokens"),
        (lambda a: a[:3], "3 rows but the trajectory has 5 tokens"),
        (
            lambda a: (a.__setitem__((2, 1, 0), 16), a)[1],
            "expert id 16 out of range.*token 2, layer 1, slot 0",
        ),
        (
            lambda a: (a.__setitem__((1, 0, 1), -3), a)[1],
            "expert id -3 out of range.*token 1, layer 0, slot 1",
        ),
        (
            lambda a: (a.__setitem__((3, 2, 1), a[3, 2, 0]), a)[1],
            "chosen twice at token 3, layer 2",
        ),
        (lambda a: (a.__setitem__((4, 0, 1), -1), a)[1], "token 4, layer 0 has 1 experts"),
    ],
)
def test_bad_topk_is_refused_with_its_position(
    mutate: Callable[[npt.NDArray[Any]], npt.NDArray[Any]], message: str
) -> None:
    with pytest.raises(InvalidRoutes, match=message):
        from_topk(mutate(good_ids()), SPEC, 5)


def test_bad_masks_are_refused_with_their_position() -> None:
    spec = RouteSpec(num_layers=2, num_experts=12, top_k=2)
    routes = from_topk(uniform_topk(np.random.default_rng(1), 4, 2, 12, 2), spec, 4)
    mask = to_mask(routes, spec)
    assert from_mask(mask, spec, 4).equals(routes)
    past = mask.copy()
    past[2, 1, 1] |= 0x20  # expert 13 of 12
    with pytest.raises(InvalidRoutes, match="bits set past expert 11 at token 2, layer 1"):
        from_mask(past, spec, 4)
    three = mask.copy()
    three[1, 0] = [0b111, 0]
    with pytest.raises(InvalidRoutes, match="token 1, layer 0 has 3 bits set"):
        from_mask(three, spec, 4)
    one = mask.copy()
    one[3, 1] = [0b1000, 0]
    with pytest.raises(InvalidRoutes, match="token 3, layer 1 has 1 experts"):
        from_mask(one, spec, 4)
    with pytest.raises(InvalidRoutes, match="must be uint8"):
        from_mask(mask.astype(np.int16), spec, 4)
    with pytest.raises(InvalidRoutes, match=r"shape \[rows, 2, 2\]"):
        from_mask(mask[..., :1], spec, 4)
    with pytest.raises(InvalidRoutes, match="keeps the top-k order"):
        from_mask(mask, RouteSpec(2, 12, 2, ordered=True), 4)


def test_unrecorded_marker() -> None:
    ids = good_ids()
    ids[2, 1] = EMPTY
    routes = from_topk(ids, SPEC, 5)
    assert routes.counts[2, 1] == 0
    assert (routes.to_topk()[2, 1] == EMPTY).all()
    mask = to_mask(routes, SPEC)
    assert not mask[2, 1].any()
    assert from_mask(mask, SPEC, 5).counts[2, 1] == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_layers": 0, "num_experts": 8, "top_k": 2},
        {"num_layers": 4, "num_experts": 8, "top_k": 9},
        {"num_layers": 4, "num_experts": 70000, "top_k": 2},
        {"num_layers": 4, "num_experts": 8, "top_k": True},
    ],
)
def test_bad_specs(kwargs: dict[str, int]) -> None:
    with pytest.raises(InvalidSpec):
        RouteSpec(**kwargs)


def test_spec_json_round_trip() -> None:
    spec = RouteSpec(48, 128, 8, ordered=True, model="Qwen3-30B-A3B")
    assert RouteSpec.from_json(spec.to_json()) == spec
    with pytest.raises(InvalidSpec):
        RouteSpec.from_json("{not json")


def entropy_bytes(experts: int, k: int) -> float:
    from math import comb, log2

    return log2(comb(experts, k)) / 8


@pytest.mark.parametrize("ordered", [False, True])
def test_uniform_routes_compress_near_the_entropy_bound(ordered: bool) -> None:
    spec = RouteSpec(48, 128, 8, ordered=ordered)
    ids = uniform_topk(np.random.default_rng(7), 2047, 48, 128, 8)
    encoded = codec.encode(from_topk(ids, spec, 2048), spec)
    per_token_layer = encoded.nbytes / (2048 * 48)
    bound = 1.10 * entropy_bytes(128, 8)
    assert per_token_layer <= bound + (2.0 if ordered else 0.0)


@pytest.mark.parametrize("generator", [skewed_topk, drifting_topk])
def test_skewed_routes_compress_no_worse_than_masks(generator: Callable[..., Any]) -> None:
    import zstandard

    spec = RouteSpec(48, 128, 8)
    routes = from_topk(generator(np.random.default_rng(3), 1023, 48, 128, 8), spec, 1024)
    ours = codec.encode(routes, spec).nbytes
    mask = to_mask(routes, spec)
    token_major = len(zstandard.ZstdCompressor(level=1).compress(mask.tobytes()))
    layer_major = len(
        zstandard.ZstdCompressor(level=1).compress(
            np.ascontiguousarray(mask.transpose(1, 0, 2)).tobytes()
        )
    )
    assert ours <= min(token_major, layer_major)


def test_corrupt_streams_raise() -> None:
    from r3store.errors import CorruptShard

    routes = from_topk(good_ids(), SPEC, 5)
    encoded = codec.encode(routes, SPEC)
    with pytest.raises(CorruptShard):
        codec.decode(dataclasses.replace(encoded, ids=encoded.ids[:-3]), SPEC, 5)
    with pytest.raises(CorruptShard):
        codec.decode(encoded, SPEC, 6)
    unknown = dataclasses.replace(encoded, transform=9)  # type: ignore[arg-type]
    with pytest.raises(CorruptShard, match="unknown route transform"):
        codec.decode(unknown, SPEC, 5)


@pytest.mark.parametrize("k", [2, 3, 8, 12])
def test_ordered_routes_come_back_in_their_slot_order_across_chunks(k: int) -> None:
    """The producer's slot order survives encode and decode for every K (Lehmer ranks up
    to 8, positions past it), rows of fewer experts included, over more token-layers
    than decoding puts back in order at a time."""
    from r3store.errors import CorruptShard

    layers, tokens = 4, 2 * codec.UNSORT_CELLS // 4 + 7
    spec = RouteSpec(layers, 300, k, ordered=True, allow_fewer=True)
    rng = np.random.default_rng(k)
    ids = np.argsort(rng.random((tokens, layers, 300)), axis=-1)[..., :k].astype(np.int32)
    held = rng.integers(0, k + 1, (tokens, layers))
    ids[np.arange(k) >= held[..., None]] = EMPTY  # fewer chosen: empty slots last
    routes = from_topk(ids, spec, tokens)
    encoded = codec.encode(routes, spec)
    back = codec.decode(encoded, spec, tokens)
    assert np.array_equal(back.to_topk(dtype=np.int32), ids)

    import zstandard

    cells = tokens * layers
    if k <= codec.LEHMER_MAX_K:  # ranks past k!
        wrong = [("rank past k!", np.full(cells, 0xFFFF, np.uint16))]
    else:  # positions past K, or one position twice
        wrong = [
            ("not a permutation", np.full(cells * k, 255, np.uint8)),
            ("not a permutation", np.zeros(cells * k, np.uint8)),
        ]
    for says, order in wrong:
        bad = zstandard.ZstdCompressor().compress(order.tobytes())
        with pytest.raises(CorruptShard, match=says):
            codec.decode(dataclasses.replace(encoded, order=bad), spec, tokens)


@pytest.mark.parametrize("k", [1, 2, 3, 5, 8])
def test_the_lehmer_table_lists_each_rank_s_permutation(k: int) -> None:
    """Row r of the table decoding ranks is the slot order that encodes to rank r."""
    table = codec.lehmer_table(k)
    assert table.shape == (factorial(k), k)
    ranks = codec._lehmer_rank([np.ascontiguousarray(table[:, i]) for i in range(k)])
    assert np.array_equal(ranks, np.arange(factorial(k)))


def test_a_row_is_one_word_where_its_bytes_make_one() -> None:
    from r3store.logic.routes import row_words

    ids = np.arange(2 * 3 * 8, dtype=np.uint8).reshape(2, 3, 8)
    words = row_words(ids)
    assert words is not None
    assert words.shape == (2, 3)
    assert words.dtype == np.uint64
    assert np.array_equal(words.view(np.uint8).reshape(ids.shape), ids)  # the same bytes
    pairs = row_words(np.ascontiguousarray(ids[..., :2], dtype=np.uint16))
    assert pairs is not None
    assert pairs.dtype == np.uint32  # two uint16 ids
    assert row_words(ids[..., :3]) is None  # 3 bytes: no word
    assert row_words(ids.transpose(1, 0, 2)) is None  # not C-contiguous
