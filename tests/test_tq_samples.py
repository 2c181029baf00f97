"""The TransferQueue backend's conversions (no TransferQueue needed): a sample's route
tensor as a trajectory and back, and the backend meta the controller keeps, refused
when it is not the backend's."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from r3store.errors import InvalidInput, InvalidRoutes, RefMismatch
from r3store.logic.writes import check_slot_order
from r3store.spec import RouteSpec
from r3store_client.tensors import CompactRoutes
from r3store_client.tq_samples import (
    SampleMeta,
    describe,
    new_trajectory_id,
    per_sample,
    read_dtype,
    sample_tensors,
    sample_write,
    turn_writes,
)
from r3store_client.turn_routes import TurnsMeta

SPEC = RouteSpec(2, 8, 2, ordered=True)


def routes(tokens: int) -> torch.Tensor:
    ids = torch.tensor([[[1, 5], [7, 0]]] * tokens, dtype=torch.int16)
    ids[-1] = 0  # verl's row without a route
    return ids


def test_a_sample_is_written_with_its_tokens_and_zero_rows_as_no_route() -> None:
    write = sample_write(
        "tq/train/x", routes(4), SPEC, token_ids=torch.arange(4), prompt_len=2, group_id="g"
    )
    assert (write.num_tokens, write.prompt_len, write.group_id) == (4, 2, "g")
    assert write.token_ids is not None
    assert write.token_ids.tolist() == [0, 1, 2, 3]
    ids = np.asarray(write.topk)
    assert ids[0].tolist() == [[1, 5], [7, 0]]  # a zero among chosen experts stays
    assert (ids[-1] == -1).all()  # K zeros: no route
    for dtype in (torch.uint8, torch.int32, torch.int64):  # any integer width, unchanged
        given = routes(3).to(dtype)
        kept = given.clone()
        made = np.asarray(sample_write("t", given, SPEC).topk)
        assert torch.equal(given, kept)  # the caller's tensor is not written
        assert made[:2].tolist() == [[[1, 5], [7, 0]]] * 2
        assert (made[-1] == -1).all()
    unrouted = np.asarray(sample_write("t", routes(3)[:2], SPEC).topk)
    assert (unrouted >= 0).all()  # no row of K zeros: the routes as given
    # token ids of another length are not the sample's: left out; a prompt past the end too
    other = sample_write("t", routes(4), SPEC, token_ids=torch.arange(5), prompt_len=9)
    assert other.token_ids is None
    assert other.prompt_len == 0

    # the engine's slots as put, no rank order: kept verbatim, which the backend's
    # ordered namespace takes (a write whose slots are a set it would refuse)
    assert (write.slot_order, write.producer) == ("verbatim", "TransferQueue")
    check_slot_order(write, SPEC)
    turns = turn_writes(sample_write("t", routes(6), SPEC), TurnsMeta((0, 3), (None, 1)))
    assert [w.slot_order for w in turns] == ["verbatim", "verbatim"]
    with pytest.raises(InvalidRoutes, match="TransferQueue promises no order"):
        check_slot_order(replace(write, slot_order="set"), SPEC)


def test_routes_of_another_shape_or_kind_are_refused() -> None:
    with pytest.raises(InvalidInput, match="3 layers and top-2 in a namespace of 2 layers"):
        sample_write("t", torch.zeros(4, 3, 2, dtype=torch.int16), SPEC)
    with pytest.raises(InvalidInput, match=r"integer tensor \[T, L, K\]"):
        describe(torch.zeros(4, 2, 2, dtype=torch.float32), "routed_experts")
    with pytest.raises(InvalidInput, match=r"integer tensor \[T, L, K\]"):
        describe(torch.zeros(4, 2, dtype=torch.int16), "routed_experts")
    with pytest.raises(InvalidInput, match="a tensor per sample"):
        per_sample([1, 2], "routed_experts")


def test_negative_ids_are_refused_a_read_would_give_back_zeros() -> None:
    for k in (2, 1):  # a row of -1s, or one -1: stored as no route, read back as zeros
        ids = routes(3)[..., :k].clone()
        ids[1, 0] = -1
        with pytest.raises(InvalidInput, match="negative ids"):
            sample_write("t", ids, RouteSpec(2, 8, k, ordered=True))


def test_samples_of_a_put_dense_or_jagged() -> None:
    dense = torch.zeros(3, 4, 2, 2, dtype=torch.int16)
    assert [tuple(t.shape) for t in per_sample(dense, "f")] == [(4, 2, 2)] * 3
    parts = [routes(3), routes(5)]
    jagged = torch.nested.as_nested_tensor(parts, layout=torch.jagged)
    got = per_sample(jagged, "f")
    assert all(torch.equal(a, b) for a, b in zip(got, parts, strict=True))


def test_trajectory_ids_are_new_each_time() -> None:
    assert new_trajectory_id("train") != new_trajectory_id("train")
    assert new_trajectory_id("val").startswith("tq/val/")


@pytest.mark.parametrize(
    "meta",
    [
        None,
        "not a dict",
        {"ref": None, "dtype": "float32", "shape": [1, 2, 2]},
        {"ref": None, "dtype": "int16", "shape": [1, 2]},
        {"ref": None, "dtype": "int16", "shape": [1, -2, 2]},
        {"ref": 7, "dtype": "int16", "shape": [1, 2, 2]},
        {"key": "another backend's"},
    ],
)
def test_a_meta_that_is_not_the_backends_is_refused(meta: object) -> None:
    with pytest.raises(RefMismatch, match="is not an r3store ref"):
        SampleMeta.from_backend(meta, "routed_experts")


def test_a_meta_round_trips() -> None:
    meta = describe(routes(3), "routed_experts")
    assert meta == SampleMeta(None, "int16", (3, 2, 2))
    assert SampleMeta.from_backend(meta.to_backend(), "routed_experts") == meta


def test_stored_routes_come_back_as_put_or_are_refused() -> None:
    ids = torch.cat([routes(3), routes(5)]).to(torch.uint8)  # packed, token-major
    counts = torch.zeros(8, 2, dtype=torch.uint8)
    resolved = CompactRoutes(ids, counts, torch.tensor([3, 5]), torch.tensor([0, 3, 8]))
    metas = [
        SampleMeta("ref-a", "int16", (3, 2, 2)),
        SampleMeta(None, "int32", (0, 2, 2)),  # no tokens: stored nowhere
        SampleMeta("ref-b", "int16", (5, 2, 2)),
    ]
    got = sample_tensors(metas, resolved, "routed_experts")
    assert torch.equal(got[0], routes(3))
    assert got[0].dtype == torch.int16
    assert got[1].shape == (0, 2, 2)
    assert got[1].dtype == torch.int32
    assert torch.equal(got[2], routes(5))
    with pytest.raises(RefMismatch, match=r"holds routes \[3, 2, 2\], but the sample was put"):
        sample_tensors([SampleMeta("ref-a", "int16", (4, 2, 2))], resolved, "routed_experts")


def test_samples_are_read_in_the_dtype_they_were_put_in_where_it_holds_every_id() -> None:
    a, b = SampleMeta("ref-a", "int16", (3, 2, 2)), SampleMeta("ref-b", "int16", (5, 2, 2))
    none = SampleMeta(None, "int32", (0, 2, 2))  # stored nowhere: no say in the dtype
    assert read_dtype([a, none, b], SPEC) == torch.int16
    assert read_dtype([a, replace(b, dtype="int32")], SPEC) is None  # the narrowest, then cast
    assert read_dtype([replace(a, dtype="uint8")], RouteSpec(2, 300, 2, ordered=True)) is None
