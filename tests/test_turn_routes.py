"""A multi-turn rollout's routes kept turn by turn (`r3store_client.turn_routes`), and a
sample with turns stored as a segment per turn on a real server: read whole, each turn
with its own policy version, behind one ref."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from http_helpers import KEYS, ServerProcess
from r3store.errors import InvalidInput
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client import Client
from r3store_client.tensors import compact
from r3store_client.tq_samples import sample_write, turn_writes
from r3store_client.turn_routes import TURNS_FIELD, Turns, TurnsMeta

L, K = 2, 2


def engine_answer(rng: np.random.Generator, covered: int, cached: int = 0) -> np.ndarray:
    """An engine's routes over `covered` rows, the first `cached` zero (a prefix-cache hit)."""
    rows = np.stack([rng.permutation(8)[:K] for _ in range(covered * L)]).reshape(covered, L, K)
    rows[:cached] = 0
    return rows.astype(np.uint8)


def test_each_turn_keeps_the_rows_it_computed() -> None:
    rng = np.random.default_rng(0)
    turns = Turns()
    prompt, first = list(range(5)), [50, 51, 52]
    one = engine_answer(rng, 7)
    assert np.array_equal(turns.add(prompt, first, one), one)
    # the tool's answer, then the next turn: its prompt is the whole conversation; the
    # engine's prefix cache covered the first 4 tokens (zero rows), and its rows for the
    # other earlier tokens are a prefill's, not those they were generated with
    second_prompt = [*prompt, *first, 90, 91]
    two = engine_answer(rng, len(second_prompt) + 2 - 1, cached=4)
    joined = turns.add(second_prompt, [60, 61], two, policy_version=3)
    assert joined.shape == (11, L, K)
    assert np.array_equal(joined[:7], one)  # turn one's rows, as it computed them
    assert np.array_equal(joined[7:], two[7:])  # from turn one's last token on: turn two's
    third_prompt = [*second_prompt, 60, 61, 92]
    three = engine_answer(rng, len(third_prompt) + 1 - 1, cached=8)
    joined = turns.add(third_prompt, [70], three, policy_version=4)
    assert np.array_equal(joined[:11], np.concatenate([one, two[7:]]))
    assert np.array_equal(joined[11:], three[11:])
    meta = turns.meta()
    assert meta == TurnsMeta((0, 7, 11), (None, 3, 4))
    assert TurnsMeta.of({TURNS_FIELD: meta.to_json()}) == meta
    # each turn a segment up to the next; a turn the agent loop cut off is left out
    assert meta.segments(14) == [(0, 7, None), (7, 4, 3), (11, 3, 4)]
    assert meta.segments(9) == [(0, 7, None), (7, 2, 3)]


def test_a_rewritten_history_or_a_wrong_shape_is_refused() -> None:
    rng = np.random.default_rng(1)
    turns = Turns()
    turns.add([1, 2, 3], [4], engine_answer(rng, 3))
    with pytest.raises(InvalidInput, match="history was rewritten"):
        turns.add([1, 9, 3, 4, 5], [6], engine_answer(rng, 5))
    with pytest.raises(InvalidInput, match=r"\[prompt \+ generated - 1, L, K\] = \[5, L, K\]"):
        turns.add([1, 2, 3, 4, 5], [6], engine_answer(rng, 6))
    with pytest.raises(InvalidInput, match="layers and top-k"):
        turns.add([1, 2, 3, 4, 5], [6], np.zeros((5, 3, K), dtype=np.uint8))
    assert turns.meta() == TurnsMeta((0,), (None,))  # nothing of the refused turns kept


@pytest.mark.parametrize(
    "value",
    [
        {TURNS_FIELD: {"starts": [1], "policy_versions": [None]}},
        {TURNS_FIELD: {"starts": [0, 4, 4], "policy_versions": [0, 1, 2]}},
        {TURNS_FIELD: {"starts": [0, 4], "policy_versions": [0]}},
        {TURNS_FIELD: {"starts": [0], "policy_versions": [-1]}},
        {TURNS_FIELD: {"starts": "0"}},
        {TURNS_FIELD: [0, 4]},
    ],
)
def test_turns_that_are_not_turns_are_refused(value: object) -> None:
    with pytest.raises(InvalidInput, match=TURNS_FIELD):
        TurnsMeta.of(value)


def test_no_turns_named_is_none() -> None:
    assert TurnsMeta.of(None) is None
    assert TurnsMeta.of({"other": 1}) is None
    assert TurnsMeta.of({TURNS_FIELD: None}) is None


def test_a_sample_with_turns_is_stored_a_segment_each(tmp_path: Path) -> None:
    spec = RouteSpec(L, 8, K, ordered=True)
    rng = np.random.default_rng(2)
    routes = torch.from_numpy(engine_answer(rng, 14).astype(np.int16))
    routes[-1] = 0  # the last token's row: no route
    turns = TurnsMeta((0, 7, 11), (None, 3, 4))
    whole = sample_write(
        "tq/train/mt",
        routes,
        spec,
        token_ids=torch.arange(14),
        prompt_len=5,
        group_id="g",
        policy_version=2,
    )
    writes = turn_writes(whole, turns)
    assert turn_writes(whole, None) == [whole]
    assert [(w.start, w.num_tokens, w.policy_version) for w in writes] == [
        (0, 7, 2),
        (7, 4, 3),
        (11, 3, 4),
    ]
    assert [(w.prompt_len, w.group_id) for w in writes] == [(5, "g"), (0, None), (0, None)]
    with (
        ServerProcess(tmp_path, None) as server,
        Client(server.url, api_key=KEYS["admin"]) as client,
    ):
        client.create_namespace("turns", spec)
        results = client.put("turns", writes)
        ref = RouteRef.joined([r.ref for r in results])
        assert ref.segments == ((0, 7), (7, 4), (11, 3))
        assert ref.policy_version == 2
        read_spec, batch = client.resolve([ref])
        got = compact(batch, read_spec, "padded", major="token", namespace="turns")
        assert int(got.lengths[0]) == 14
        ids = got.ids[0, :13].to(torch.int16)
        assert torch.equal(ids, routes[:-1])  # every turn's rows, whole, in order
