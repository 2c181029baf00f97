"""Replay through Megatron-Core's own RouterReplay, on CPU with real megatron-core.

Routes recorded by Megatron (RECORD) go through r3store and come back to be replayed
(REPLAY_FORWARD, REPLAY_BACKWARD under recomputation) into an identical routing map;
the token order of every parallel layout is checked against Megatron's own helpers in
real gloo process groups (sequence parallel, context parallel, both, packed sequences,
pipeline stages with virtual chunks, a dense first layer and a stage of dense layers
only). Two models replay side by side, each its own routes; a batch in another order
than its routes, or in another layout than declared, raises naming the trajectory,
from the token ids stored with the routes (checked in every layout).
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
import torch

from helpers import make_write
from http_helpers import KEYS, ServerProcess
from megatron_world import causal_mask, cpu_shims, quiet, spawn, tiny_config, tiny_gpt, world
from r3store.errors import InvalidRoutes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store_client import Client
from r3store_client.megatron import (
    MegatronReplay,
    Parallel,
    TokenLayout,
    check_tokens,
    gather_recorded,
    router_tokens,
)
from r3store_client.reader import TrainerReader
from r3store_client.tensors import CompactRoutes, Origin, RouteTensors
from r3store_client.token_check import GateNotChecked, TokenMismatch, TokensNotChecked

quiet()
SPEC = RouteSpec(num_layers=2, num_experts=8, top_k=2)  # the tiny model's two MoE layers
B, S = 2, 8


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with cpu_shims(), world():
        yield


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Client]:
    server = ServerProcess(tmp_path_factory.mktemp("server"), None)
    try:
        with Client(server.url, KEYS["admin"]) as made:
            yield made
    finally:
        server.stop()


def gpt(seed: int = 0, **config: Any) -> Any:
    torch.manual_seed(seed)
    made = tiny_gpt(tiny_config(**config))
    for p in made.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return made


@pytest.fixture
def model(megatron: None) -> Any:
    return gpt()


def stored(
    client: Client,
    namespace: str,
    names: Sequence[str],
    ids: torch.Tensor,
    seen: torch.Tensor,
    lengths: Sequence[int],
    tokens: Sequence[torch.Tensor] | None,
) -> CompactRoutes:
    """Recorded routes `[B, T, L, K]` (`seen` where recorded) through r3store: stored
    with their sequences' token ids (unless None), fetched back for a trainer."""
    client.create_namespace(namespace, SPEC)
    writes = []
    for b, (name, n) in enumerate(zip(names, lengths, strict=True)):
        topk = torch.where(seen[b, :n, :, None], ids[b, :n], -1).numpy()
        token_ids = None if tokens is None else tokens[b].numpy().astype(np.int32)
        writes.append(TrajectoryWrite(name, n, topk=topk, token_ids=token_ids))
    client.put(namespace, writes)
    routes = TrainerReader(client, namespace).fetch(list(names))
    assert isinstance(routes, CompactRoutes)
    return routes


def drift(replay: MegatronReplay) -> None:
    """The trainer's routers drift away from the engine's."""
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight))


def forward(model: Any, tokens: torch.Tensor) -> torch.Tensor:
    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    out: torch.Tensor = model(tokens, positions, causal_mask(tokens.shape[1]))
    return out


def routing_maps(model: Any) -> tuple[list[torch.Tensor], Any]:
    """Capture every router's routing map `[N, E]` of the forward passes that follow."""
    from megatron.core.transformer.moe.router import TopKRouter

    maps: list[torch.Tensor] = []
    handles = [
        m.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
        for m in model.modules()
        if isinstance(m, TopKRouter)
    ]
    return maps, handles


def test_record_store_fetch_and_replay_exactly(model: Any, client: Client) -> None:
    replay = MegatronReplay(model, SPEC)
    assert replay.layers == [0, 1]  # layer 1 is dense: the routes hold only MoE layers
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(1))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    maps, handles = routing_maps(model)
    with torch.no_grad(), replay.record() as recorded:
        forward(model, tokens)
    first = list(maps)
    ids, seen = gather_recorded(recorded, layout, replay.layers, SPEC)
    assert bool(seen.all())
    routes = stored(client, "mg", ["s0", "s1"], ids, seen, [S, S], list(tokens))
    assert routes.tokens is not None
    assert routes.origin == Origin("mg", ("s0", "s1"), ())

    drift(replay)
    maps.clear()
    with torch.no_grad():
        forward(model, tokens)
    assert any(not torch.equal(a, b) for a, b in zip(first, maps, strict=True)), "no drift"

    maps.clear()
    with replay.micro_batch(routes, layout) as step:  # the tokens checked, and the same
        loss = forward(model, tokens).float().pow(2).mean()
        step.backward(loss)
    for handle in handles:
        handle.remove()
    assert len(maps) == len(first)
    for want, got in zip(first, maps, strict=True):
        assert torch.equal(want, got)  # the engine's experts, exactly
    for router in replay.routers:  # the router still learns
        assert router.weight.grad is not None
        assert float(router.weight.grad.abs().sum()) > 0
    replay.detach()


def copy_of(model: Any, **config: Any) -> Any:
    torch.manual_seed(0)
    other = tiny_gpt(tiny_config(**config))
    other.load_state_dict(model.state_dict())
    return other


def recorded_routes(model: Any, replay: MegatronReplay, tokens: torch.Tensor) -> RouteTensors:
    """What the live routers choose for `tokens`, as routes carrying those tokens."""
    layout = TokenLayout.sbhd([tokens.shape[1]] * tokens.shape[0], seq_len=tokens.shape[1])
    with torch.no_grad(), replay.record() as recorded:
        forward(model, tokens)
    ids, seen = gather_recorded(recorded, layout, replay.layers, SPEC)
    lengths = torch.tensor(layout.lengths, dtype=torch.int32)
    names = tuple(f"r{b}" for b in range(tokens.shape[0]))
    valid = seen[..., None].expand(ids.shape).clone()
    return RouteTensors(ids, valid, lengths, None, tokens.to(torch.int32), Origin(None, names))


def grads_of(model: Any) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize(
    "recompute",
    [
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
        {"recompute_granularity": "selective", "recompute_modules": ["moe"]},
    ],
    ids=["full", "selective-moe"],
)
def test_recomputation_replays_this_micro_batch(model: Any, recompute: dict[str, Any]) -> None:
    """Under recomputation the backward pass routes again (REPLAY_BACKWARD pops the
    routes queued by set_replay_data): with the queue cleared between micro-batches it
    replays this micro-batch's routes, and the gradients equal those without
    recomputation."""
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    generator = torch.Generator().manual_seed(2)
    first, second = (torch.randint(0, 64, (B, S), generator=generator) for _ in range(2))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    replay = MegatronReplay(model, SPEC)
    routes = [recorded_routes(model, replay, t) for t in (first, second)]
    drift(replay)
    plain = copy_of(model)
    replay = MegatronReplay(plain, SPEC)
    with replay.micro_batch(routes[1], layout):
        forward(plain, second).float().pow(2).mean().backward()
    want = grads_of(plain)
    replay.detach()

    recomputing = copy_of(model, **recompute)
    replay = MegatronReplay(recomputing, SPEC)
    with torch.no_grad(), replay.micro_batch(routes[0], layout):
        forward(recomputing, first)  # a forward only (old log-probs, say): nothing pops
    with replay.micro_batch(routes[1], layout) as step:
        step.backward(forward(recomputing, second).float().pow(2).mean())
    got = grads_of(recomputing)
    assert all(not i.replay_backward_list for i in replay.instances)  # all consumed
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b)

    # a pipeline schedule: both forwards, then both backwards (recomputation pops the
    # micro-batches in the order queued)
    recomputing.zero_grad()
    replay.new_step()
    losses = []
    for tokens, micro in zip((first, second), routes, strict=True):
        replay.queue(micro, layout)
        losses.append(forward(recomputing, tokens).float().pow(2).mean())
    replay.before_backward()
    for loss in losses:
        loss.backward()
    both = grads_of(recomputing)
    recomputing.zero_grad()
    for tokens, micro in zip((first, second), routes, strict=True):
        with replay.micro_batch(micro, layout) as step:
            step.backward(forward(recomputing, tokens).float().pow(2).mean())
    for a, b in zip(both, grads_of(recomputing), strict=True):
        torch.testing.assert_close(a, b)

    # without clearing in between, the recomputation of the second micro-batch pops the
    # routes the first one queued: the mistake the adapter prevents
    recomputing.zero_grad()
    RouterReplay.set_replay_data(replay.indices(routes[0], layout))
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    with torch.no_grad():
        forward(recomputing, first)
    RouterReplay.set_replay_data(replay.indices(routes[1], layout))
    loss = forward(recomputing, second).float().pow(2).mean()
    RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
    loss.backward()
    stale = grads_of(recomputing)
    assert any(not torch.allclose(a, b) for a, b in zip(stale, want, strict=True))
    replay.finish()
    replay.detach()


def test_unrecorded_token_layers_follow_the_live_router(model: Any) -> None:
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(3))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    replay = MegatronReplay(model, SPEC)
    routes = recorded_routes(model, replay, tokens)
    routes.valid[1, 5:] = False  # the engine routed none of sequence 1's last 3 tokens
    routes.valid[0, :, 1] = False  # nor layer 1 of sequence 0
    drift(replay)
    maps, handles = routing_maps(model)
    with torch.no_grad():
        forward(model, tokens)  # live, with the drifted routers
    live = list(maps)
    maps.clear()
    with torch.no_grad(), replay.micro_batch(routes, layout):
        forward(model, tokens)
    for handle in handles:
        handle.remove()
    seq, tok = layout.sequence, layout.token
    for layer, (got, drifted) in enumerate(zip(maps, live, strict=True)):
        recorded = routes.valid[seq, tok, layer].all(dim=-1)
        replayed = torch.zeros_like(got).scatter(1, routes.ids[seq, tok, layer].long(), True)
        assert torch.equal(got[recorded], replayed[recorded])
        assert torch.equal(got[~recorded], drifted[~recorded])
        assert int((~recorded).sum()) > 0
        assert int(got.sum(dim=-1).min()) == SPEC.top_k  # never fewer, never repeated
    replay.detach()


@pytest.mark.parametrize(
    ("config", "spec", "message"),
    [
        ({}, RouteSpec(2, 8, 3), "top-k 2 (routes: 3)"),
        ({}, RouteSpec(2, 16, 2), "8 experts (routes: 16)"),
        ({}, RouteSpec(5, 8, 2), "the routes have 5 layers; the model has 2 MoE layers of 3"),
        ({"moe_enable_routing_replay": False}, SPEC, "moe_enable_routing_replay=True"),
        ({"moe_expert_capacity_factor": 1.0}, SPEC, "token dropping"),
        ({"moe_router_load_balancing_type": "sinkhorn"}, SPEC, "sinkhorn"),
        (  # the spec's model names a gate the config's router does not apply
            {},
            RouteSpec(2, 8, 2, model="deepseek-ai/DeepSeek-V3"),
            "whose gate is sigmoid, renormalised, a bias that only chooses; the Megatron "
            "config's router applies softmax, renormalised",
        ),
        (
            {"moe_router_pre_softmax": True},
            RouteSpec(2, 8, 2, model="Qwen/Qwen3-30B-A3B"),
            "softmax, renormalised; the Megatron config's router applies softmax, not",
        ),
    ],
)
def test_attaching_checks_the_model(
    megatron: None, config: dict[str, Any], spec: RouteSpec, message: str
) -> None:
    made = tiny_gpt(tiny_config(**config))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        MegatronReplay(made, spec)


def test_instances_of_a_temporary_model_do_not_leak(megatron: None) -> None:
    from megatron.core.transformer.moe.router_replay import RouterReplay

    tiny_gpt(tiny_config())  # say, a model built only to extract weights
    model = tiny_gpt(tiny_config())
    assert len(RouterReplay.global_router_replay_instances) >= 4
    replay = MegatronReplay(model, SPEC)
    assert RouterReplay.global_router_replay_instances == replay.instances
    assert len(replay.instances) == 2
    replay.detach()
    assert RouterReplay.global_router_replay_instances == []


def test_the_gate_of_the_specs_model(megatron: None) -> None:
    """The gate the spec's `model` names, against the config's router: the same gate
    attaches (Mixtral's normalised softmax; DeepSeek-V3's biased sigmoid), a name whose
    gate is not known attaches with a warning."""
    for config, name in (
        ({}, "mistralai/Mixtral-8x7B-v0.1"),
        ({"moe_router_pre_softmax": True}, "allenai/OLMoE-1B-7B-0924"),
        (
            {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
            "deepseek-ai/DeepSeek-V3",
        ),
    ):
        MegatronReplay(tiny_gpt(tiny_config(**config)), RouteSpec(2, 8, 2, model=name)).detach()
    made = tiny_gpt(tiny_config())  # (Megatron's own warnings outside the block)
    with pytest.warns(GateNotChecked, match="'acme/moe-7b' is not one whose gate replay knows"):
        MegatronReplay(made, RouteSpec(2, 8, 2, model="acme/moe-7b")).detach()


def test_two_models_each_replay_their_own_routes(megatron: None) -> None:
    """An actor and a reference model in one process, each with its own MegatronReplay:
    each records and replays exactly its own routes, one inside the other's micro-batch
    too, whichever was attached last."""
    from megatron.core.transformer.moe.router_replay import RouterReplay

    actor, reference = gpt(0), gpt(1)
    replay_a, replay_b = MegatronReplay(actor, SPEC), MegatronReplay(reference, SPEC)
    assert RouterReplay.global_router_replay_instances == replay_a.instances + replay_b.instances
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(4))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    pairs = ((actor, replay_a), (reference, replay_b))
    wanted, routes = [], []
    for made, replay in pairs:
        maps, handles = routing_maps(made)
        routes.append(recorded_routes(made, replay, tokens))  # its own recorded routes
        for handle in handles:
            handle.remove()
        wanted.append(maps)
    assert not torch.equal(routes[0].ids, routes[1].ids)  # two models, two routings
    for _made, replay in pairs:
        drift(replay)

    for (made, replay), micro, want in zip(pairs, routes, wanted, strict=True):
        maps, handles = routing_maps(made)
        with replay.micro_batch(micro, layout) as step:
            step.backward(forward(made, tokens).float().pow(2).mean())
        for handle in handles:
            handle.remove()
        assert all(torch.equal(a, b) for a, b in zip(want, maps, strict=True))

    # the reference model's log-probs inside the actor's micro-batch
    maps_a, handles_a = routing_maps(actor)
    maps_b, handles_b = routing_maps(reference)
    with replay_a.micro_batch(routes[0], layout) as step:
        loss = forward(actor, tokens).float().pow(2).mean()
        with torch.no_grad(), replay_b.micro_batch(routes[1], layout):
            forward(reference, tokens)
        step.backward(loss)
    for handle in handles_a + handles_b:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(wanted[0], maps_a, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(wanted[1], maps_b, strict=True))

    # the same routers attached again: the earlier replay refuses to drive them
    again = MegatronReplay(actor, SPEC)
    with pytest.raises(RuntimeError, match="another MegatronReplay was attached"):
        replay_a.load(routes[0], layout)
    replay_a.detach()  # leaves the routers to the replay that has them now
    assert set(map(id, again.instances)) <= set(
        map(id, RouterReplay.global_router_replay_instances)
    )
    maps, handles = routing_maps(actor)
    with torch.no_grad(), again.micro_batch(routes[0], layout):
        forward(actor, tokens)
    for handle in handles:
        handle.remove()
    assert all(torch.equal(a, b) for a, b in zip(wanted[0], maps, strict=True))
    again.detach()
    replay_b.detach()
    assert RouterReplay.global_router_replay_instances == []


def test_a_batch_in_another_order_than_its_routes_raises(model: Any, client: Client) -> None:
    """Equal lengths, routes `[o0, o1]`, the batch `[o1, o0]`: the stored token ids tell,
    before backward, naming the trajectory and its first differing token."""
    replay = MegatronReplay(model, SPEC)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(5))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    routes = stored(
        client, "order", ["o0", "o1"], *gather(model, replay, tokens, layout), [S, S], list(tokens)
    )
    swapped = tokens.flip(0)
    differs = int((tokens[0] != tokens[1]).nonzero()[0, 0])
    message = (
        rf"trajectory 'o0' \(sequence 0 of the micro-batch\): token {differs} is "
        rf"{int(tokens[1, differs])} in the batch but {int(tokens[0, differs])} in the routes "
        r"stored in namespace 'order'"
    )
    with pytest.raises(TokenMismatch, match=message), replay.micro_batch(routes, layout) as step:
        step.backward(forward(model, swapped).float().pow(2).mean())
    assert all(p.grad is None for p in model.parameters())  # refused before backward
    with (  # a forward only: raised at the block's end
        pytest.raises(TokenMismatch, match="'o0'"),
        torch.no_grad(),
        replay.micro_batch(routes, layout),
    ):
        forward(model, swapped)
    with (  # the tokens given, not hooked
        pytest.raises(TokenMismatch, match="'o0'"),
        replay.micro_batch(routes, layout, tokens=swapped),
    ):
        pass
    with torch.no_grad(), replay.micro_batch(routes, layout):
        forward(model, tokens)  # the routes' own order
    # the pipeline schedule's calls: checked when backward begins
    replay.new_step()
    replay.queue(routes, layout)
    loss = forward(model, swapped).float().pow(2).mean()
    with pytest.raises(TokenMismatch, match="'o0'"):
        replay.before_backward()
    replay.finish()
    # turned off, the order rests on the caller again
    unchecked = MegatronReplay(model, SPEC, check_tokens=False)
    with torch.no_grad(), unchecked.micro_batch(routes, layout):
        forward(model, swapped)
    unchecked.detach()
    del loss


def gather(
    model: Any, replay: MegatronReplay, tokens: torch.Tensor, layout: TokenLayout
) -> tuple[torch.Tensor, torch.Tensor]:
    """The live routers' routes of `tokens` in `layout` (`[B, T, L, K]`, seen)."""
    with torch.no_grad(), replay.record() as recorded:
        forward(model, tokens)
    return gather_recorded(recorded, layout, replay.layers, SPEC)


def test_a_layout_that_is_not_the_batchs_raises(model: Any, client: Client) -> None:
    """A left-padded batch replayed without `first=`, an sbhd batch declared thd: the
    routers would see other tokens than the routes', and replay says which."""
    replay = MegatronReplay(model, SPEC)
    generator = torch.Generator().manual_seed(6)
    real = [torch.randint(1, 64, (n,), generator=generator) for n in (S, 5)]
    batch = torch.zeros((B, S), dtype=torch.long)  # sequence 1 left-padded with token 0
    batch[0], batch[1, 3:] = real[0], real[1]
    right = TokenLayout.sbhd([S, 5], seq_len=S, first=[0, 3])
    maps, handles = routing_maps(model)
    ids, seen = gather(model, replay, batch, right)
    recorded = list(maps)
    routes = stored(client, "left", ["l0", "l1"], ids, seen, [S, 5], real)
    drift(replay)
    maps.clear()
    with torch.no_grad(), replay.micro_batch(routes, right):
        forward(model, batch)
    rows = right.sequence >= 0
    for want, got in zip(recorded, maps, strict=True):
        assert torch.equal(want[rows], got[rows])  # left padding, declared: exact
    for handle in handles:
        handle.remove()
    with (
        pytest.raises(TokenMismatch, match=r"trajectory 'l1' .*: token 0 is 0 in the batch"),
        torch.no_grad(),
        replay.micro_batch(routes, TokenLayout.sbhd([S, 5], seq_len=S)),
    ):
        forward(model, batch)  # first= left out

    tokens = torch.randint(0, 64, (B, S), generator=generator)
    sbhd = TokenLayout.sbhd([S, S], seq_len=S)
    routes = stored(
        client, "declared", ["d0", "d1"], *gather(model, replay, tokens, sbhd), [S, S], list(tokens)
    )
    with (
        pytest.raises(TokenMismatch, match=r"trajectory 'd0' .*the thd layout is not the batch"),
        torch.no_grad(),
        replay.micro_batch(routes, TokenLayout.thd([S, S])),
    ):
        forward(model, tokens)  # as many tokens, in another order
    with (
        pytest.raises(InvalidRoutes, match=r"input ids \[2, 8\] give this rank's routers 16"),
        torch.no_grad(),
        replay.micro_batch(routes, TokenLayout.sbhd([S, S], seq_len=12)),
    ):
        forward(model, tokens)
    replay.detach()


def packed_routes(lengths: Sequence[int]) -> RouteTensors:
    """Routes whose stored tokens are distinct across sequences (`1000 (b + 1) + t`)."""
    width = max(lengths)
    tokens = torch.full((len(lengths), width), -1, dtype=torch.int32)
    for b, n in enumerate(lengths):
        tokens[b, :n] = 1000 * (b + 1) + torch.arange(n, dtype=torch.int32)
    shape = (len(lengths), width, SPEC.num_layers, SPEC.top_k)
    ids = torch.arange(SPEC.top_k, dtype=torch.int32).expand(shape).contiguous()
    valid = torch.ones(shape, dtype=torch.bool)
    names = tuple(f"t{b}" for b in range(len(lengths)))
    return RouteTensors(ids, valid, torch.tensor(lengths), None, tokens, Origin("w", names))


def pack(routes: RouteTensors, padded: Sequence[int], order: Sequence[int]) -> torch.Tensor:
    """The packed `[1, t]` input of the routes' sequences in slot order `order`, each
    slot padded with token 0."""
    assert routes.tokens is not None
    parts = []
    for slot, b in zip(padded, order, strict=True):
        n = int(routes.lengths[b])
        part = torch.zeros(slot, dtype=torch.long)
        part[:n] = routes.tokens[b, :n]
        parts.append(part)
    return torch.cat(parts)[None]


def test_packed_sequences_are_checked(model: Any) -> None:
    lengths, padded = [5, 11, 7], [8, 16, 8]
    routes = packed_routes(lengths)
    layout = TokenLayout.thd(lengths, [0, 8, 24, 32])
    replay = MegatronReplay(model, SPEC)
    replay.queue(routes, layout, tokens=pack(routes, padded, [0, 1, 2]))
    replay.verify()
    replay.new_step()
    replay.queue(routes, layout, tokens=pack(routes, padded, [2, 1, 0]))  # 0 and 2 swapped
    with pytest.raises(TokenMismatch, match=r"trajectory 't0' .*: token 0 is 3000 in the batch"):
        replay.verify()
    replay.detach()


def test_routes_without_token_ids_are_replayed_unchecked_said_once(
    model: Any, client: Client
) -> None:
    replay = MegatronReplay(model, SPEC)
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(7))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    ids, seen = gather(model, replay, tokens, layout)
    routes = stored(client, "untokened", ["u0", "u1"], ids, seen, [S, S], None)
    assert routes.tokens is None
    assert routes.origin.untokened == ("u0", "u1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.no_grad(), replay.micro_batch(routes, layout):
            forward(model, tokens.flip(0))  # unchecked: nothing can tell
        with torch.no_grad(), replay.micro_batch(routes, layout):
            forward(model, tokens)
        quiet = MegatronReplay(model, SPEC, check_tokens=False)
        routes = stored(client, "untokened-quiet", ["q0", "q1"], ids, seen, [S, S], None)
        with torch.no_grad(), quiet.micro_batch(routes, layout):  # turned off: not said
            forward(model, tokens)
    said = [str(w.message) for w in caught if issubclass(w.category, TokensNotChecked)]
    assert len(said) == 1  # once, for the namespace that stores no token ids
    assert said[0].startswith("namespace 'untokened': the routes were stored without token ids")
    assert "check_tokens=False" in said[0]
    quiet.detach()


# ---- parallel layouts, in real gloo worlds: Megatron's own helpers are the oracle


def _pairs(layout: TokenLayout) -> list[tuple[int, int]]:
    return list(zip(layout.sequence.tolist(), layout.token.tolist(), strict=True))


def checked(routes: RouteTensors, layout: TokenLayout, input_ids: torch.Tensor) -> str | None:
    """The token check of this rank's input ids: None when it passes, else its error."""
    check = check_tokens(routes, layout, input_ids)
    assert check is not None
    try:
        check.verify()
    except TokenMismatch as exc:
        return str(exc)
    return None


def sp_oracle(input_ids: torch.Tensor, sequence_parallel: bool) -> list[int]:
    """The tokens this rank's routers see, by Megatron's helpers: the `[s, b]`
    activations of the input, scattered to the sequence-parallel region."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region

    activations = input_ids.reshape(-1, input_ids.shape[-1]).t().contiguous().double()
    if sequence_parallel:
        activations = scatter_to_sequence_parallel_region(activations)
    return [int(x) for x in activations.reshape(-1).tolist()]


def _found(
    want: list[tuple[int, int]],
    got: TokenLayout,
    parallel: Parallel,
    sequence_parallel: bool,
    routes: RouteTensors,
    mine: torch.Tensor,
    swapped: torch.Tensor,
) -> dict[str, Any]:
    """What a rank reports: the (sequence, position) its routers see of each token by
    Megatron's helpers (`want`) and by `got`; whether `router_tokens` gives this rank's
    input `mine` as they do; the token check of `mine` and of an input with sequences
    swapped."""
    return {
        "want": want,
        "got": _pairs(got),
        "router_tokens": router_tokens(mine, parallel).tolist()
        == sp_oracle(mine, sequence_parallel),
        "checked": checked(routes, got, mine),
        "swapped": checked(routes, got, swapped),
    }


def sbhd_rank(lengths: list[int], seq: int, sequence_parallel: bool) -> dict[str, Any]:
    """What this rank's routers see of a `[b, s]` batch, by Megatron's helpers (the CP
    split of the batch, the `[s, b]` activations, the SP scatter), and by TokenLayout;
    the token check of this rank's input, of the batch and of the batch with two
    sequences swapped."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    batch = len(lengths)
    grid = torch.arange(batch * seq, dtype=torch.float32).view(batch, seq)  # b * seq + s
    local = get_batch_on_this_cp_rank({"tokens": grid})["tokens"]
    activations = local.t().contiguous()  # [s, b], as the transformer holds them
    if sequence_parallel:
        activations = scatter_to_sequence_parallel_region(activations)
    flat = activations.reshape(-1).long()
    b, s = flat // seq, flat % seq
    real = s < torch.tensor(lengths)[b]
    want = list(
        zip(torch.where(real, b, -1).tolist(), torch.where(real, s, -1).tolist(), strict=True)
    )
    parallel = Parallel.of_this_rank(sequence_parallel)
    got = TokenLayout.sbhd(lengths, seq, parallel)

    routes = packed_routes(lengths)
    assert routes.tokens is not None
    inputs = torch.zeros((batch, seq), dtype=torch.long)
    inputs[:, : routes.tokens.shape[1]] = routes.tokens.clamp(min=0)
    mine = get_batch_on_this_cp_rank({"tokens": inputs})["tokens"]
    swapped = get_batch_on_this_cp_rank({"tokens": inputs[[1, 0, 2]]})["tokens"]
    return _found(want, got, parallel, sequence_parallel, routes, mine, swapped)


def thd_rank(lengths: list[int], padded: list[int], sequence_parallel: bool) -> dict[str, Any]:
    """The same for packed sequences: Megatron's CP split applied to each sequence's
    padded slot (`get_thd_batch_on_this_cp_rank` needs Transformer Engine; per sequence
    it is this split), then the SP scatter of the packed `[t, 1]` activations."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    bounds = np.concatenate([[0], np.cumsum(padded)]).tolist()

    def local(packed: torch.Tensor) -> torch.Tensor:
        parts = []
        for i in range(len(lengths)):
            slot = packed[:, bounds[i] : bounds[i + 1]]
            parts.append(get_batch_on_this_cp_rank({"tokens": slot})["tokens"][0])
        return torch.cat(parts)

    activations = local(torch.arange(bounds[-1], dtype=torch.float32)[None])[:, None]  # [t, 1]
    if sequence_parallel:
        activations = scatter_to_sequence_parallel_region(activations)
    want = []
    for p in activations.reshape(-1).long().tolist():
        i = int(np.searchsorted(bounds, p, side="right")) - 1
        j = p - bounds[i]
        want.append((i, j) if j < lengths[i] else (-1, -1))
    parallel = Parallel.of_this_rank(sequence_parallel)
    got = TokenLayout.thd(lengths, bounds, parallel)

    routes = packed_routes(lengths)
    mine = local(pack(routes, padded, [0, 1, 2]))[None]  # [1, t] on this CP rank
    swapped = local(pack(routes, padded, [2, 1, 0]))[None]  # slots of 8: 0 and 2 swapped
    return _found(want, got, parallel, sequence_parallel, routes, mine, swapped)


def both_layouts(
    lengths: list[int], seq: int, packed: list[int], padded: list[int], sequence_parallel: bool
) -> dict[str, Any]:
    return {
        "sbhd": sbhd_rank(lengths, seq, sequence_parallel),
        "thd": thd_rank(packed, padded, sequence_parallel),
    }


@pytest.mark.parametrize(
    ("world_size", "parallel", "sequence_parallel"),
    [
        (2, {"tp": 2}, True),
        (2, {"cp": 2}, False),
        (4, {"tp": 2, "cp": 2}, True),
    ],
    ids=["tp2-sp", "cp2", "tp2-sp-cp2"],
)
def test_token_order_matches_megatron(
    world_size: int, parallel: dict[str, int], sequence_parallel: bool
) -> None:
    lengths, seq = [16, 11, 5], 16  # right-padded sequences
    padded_lengths, padded = [5, 11, 7], [8, 16, 8]  # packed, each padded to 2*cp*tp
    results = spawn(
        world_size,
        both_layouts,
        lengths,
        seq,
        padded_lengths,
        padded,
        sequence_parallel,
        **parallel,
    )
    ranks = [r["sbhd"] for r in results]
    packed = [r["thd"] for r in results]
    for results, counts in ((ranks, lengths), (packed, padded_lengths)):
        union: list[tuple[int, int]] = []
        for result in results:
            assert result["got"] == result["want"]
            union += [pair for pair in result["got"] if pair[0] >= 0]
            # the token check: this rank's routers' tokens as Megatron's SP scatter
            # gives them; the batch's own tokens pass, swapped sequences are named
            assert result["router_tokens"]
            assert result["checked"] is None
            assert result["swapped"] is not None
            assert "trajectory 't0'" in result["swapped"] or "trajectory 't2'" in result["swapped"]
        everything = [(i, j) for i, n in enumerate(counts) for j in range(n)]
        assert sorted(union) == everything  # every token on exactly one rank


def pipeline_rank(layer_pattern: list[int], vp: int | None) -> dict[str, Any]:
    """This stage's routers mapped to the routes' layers, beside the layers Megatron's
    offset helpers say the stage builds; a stage of dense layers only replays nothing,
    without an error."""
    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    config = tiny_config(
        num_layers=len(layer_pattern),
        moe_layer_freq=layer_pattern,
        pipeline_model_parallel_size=2,
        virtual_pipeline_model_parallel_size=vp,
        pipeline_dtype=torch.float32,
    )
    stages = [None] if vp is None else list(range(vp))
    chunks = [tiny_gpt(config, vp_stage=stage) for stage in stages]
    moe = [i for i, is_moe in enumerate(layer_pattern) if is_moe]
    spec = RouteSpec(num_layers=len(moe), num_experts=8, top_k=2)
    replay = MegatronReplay(chunks, spec)
    want = []
    for stage in stages:
        offset = get_transformer_layer_offset(config, vp_stage=stage)
        built = get_num_layers_to_build(config, vp_stage=stage)
        want += [moe.index(n) for n in range(offset, offset + built) if n in moe]
    tokens = torch.arange(4)[None]
    routes = RouteTensors(
        torch.arange(2, dtype=torch.int32).expand((1, 4, spec.num_layers, 2)).contiguous(),
        torch.ones((1, 4, spec.num_layers, 2), dtype=torch.bool),
        torch.tensor([4], dtype=torch.int32),
        None,
        tokens.to(torch.int32),
        Origin("pp", ("p0",)),
    )
    layout = TokenLayout.sbhd([4], 4)
    indices = replay.indices(routes, layout)
    dense: dict[str, Any] | None = None
    if not replay.routers:  # attaching, loading, a forward and recording do nothing
        with torch.no_grad(), replay.micro_batch(routes, layout):
            hidden = chunks[0](tokens, torch.arange(4)[None], causal_mask(4))
        with replay.record() as recorded:
            pass
        dense = {"hidden": list(hidden.shape), "recorded": recorded}
    return {"got": replay.layers, "want": want, "loaded": len(indices), "dense": dense}


@pytest.mark.parametrize(
    ("vp", "pattern"),
    [
        (None, [0, 1, 1, 0, 1, 1, 1, 1]),  # a dense first layer, and one in the middle
        (2, [0, 1, 1, 0, 1, 1, 1, 1]),
        (None, [0, 0, 0, 0, 1, 1, 1, 1]),  # the first stage dense only
    ],
    ids=["pp2", "pp2-vp2", "pp2-dense-stage"],
)
def test_pipeline_stages_take_their_own_moe_layers(vp: int | None, pattern: list[int]) -> None:
    ranks = spawn(2, pipeline_rank, pattern, vp, pp=2, vp=vp)
    union = []
    for result in ranks:
        assert result["got"] == result["want"]
        assert result["loaded"] == len(result["got"])
        union += result["got"]
    assert sorted(union) == list(range(sum(pattern)))
    if pattern[:4] == [0, 0, 0, 0]:
        assert ranks[0]["got"] == []
        assert ranks[0]["dense"] == {"hidden": [4, 1, 32], "recorded": []}


def test_a_stage_reads_only_the_layers_its_routers_replay(model: Any, client: Client) -> None:
    """Routers mapped to layer 1 only (a pipeline stage's view): only that layer is
    read, and the replay data equals what the whole routes give."""
    replay = MegatronReplay(model, SPEC, layers=[1, 1])
    assert replay.needed_layers == [1]
    rng = np.random.default_rng(3)
    client.create_namespace("stage", SPEC)
    writes = [
        TrajectoryWrite(
            f"t{b}",
            S,
            topk=np.stack([rng.permutation(8)[:2] for _ in range(S * 2)]).reshape(S, 2, 2),
            token_ids=rng.integers(0, 64, S).astype(np.int32),
        )
        for b in range(B)
    ]
    refs = [r.ref for r in client.put("stage", writes)]
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    whole = TrainerReader(client, "stage").fetch(refs)
    mine = TrainerReader(client, "stage", layers=replay.needed_layers).fetch(refs)
    assert mine.ids.shape[2] == 1
    assert mine.origin.layers == (1,)
    for got, want in zip(replay.indices(mine, layout), replay.indices(whole, layout), strict=True):
        assert torch.equal(got, want)
    other = TrainerReader(client, "stage", layers=[0]).fetch(refs)
    with pytest.raises(ValueError, match="read them with layers="):
        replay.indices(other, layout)
    replay.detach()


def other_ranks() -> dict[str, str | None]:
    """A layout declared for this rank, and for other ranks (tensor-parallel rank,
    context-parallel rank, sequence parallelism flipped): queued with the input ids cut
    by the same layout, and checked alone. Routers of a TP=2, SP model."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import get_batch_on_this_cp_rank

    config = tiny_config(
        tensor_model_parallel_size=2, context_parallel_size=2, sequence_parallel=True
    )
    routers = torch.nn.ModuleList()
    for number in (2, 3):  # the MoE layers of tiny_config's pattern [0, 1, 1]
        router = TopKRouter(config, pg_collection=ProcessGroupCollection.use_mpu_process_groups())
        router.set_layer_number(number)
        routers.append(router)
    replay = MegatronReplay(routers, SPEC)
    lengths, seq = [16, 11, 5], 16
    routes = packed_routes(lengths)
    assert routes.tokens is not None
    inputs = torch.zeros((len(lengths), seq), dtype=torch.long)
    inputs[:, : routes.tokens.shape[1]] = routes.tokens.clamp(min=0)
    mine = get_batch_on_this_cp_rank({"tokens": inputs})["tokens"]
    here = Parallel.of_this_rank(sequence_parallel=True)
    declared = {
        "this rank": here,
        "tp rank": dataclasses.replace(here, tp_rank=1 - here.tp_rank),
        "cp rank": dataclasses.replace(here, cp_rank=1 - here.cp_rank),
        "no sp": dataclasses.replace(here, sequence_parallel=False),
    }
    out: dict[str, str | None] = {}
    for name, parallel in declared.items():
        layout = TokenLayout.sbhd(lengths, seq, parallel)
        try:
            replay.queue(routes, layout, tokens=mine)
            replay.verify()
            out[name] = None
        except InvalidRoutes as exc:
            out[name] = str(exc)
        replay.finish()
        try:
            check = check_tokens(routes, layout, mine)
            assert check is not None
            check.verify()
            out[f"{name}, alone"] = None
        except InvalidRoutes as exc:
            out[f"{name}, alone"] = str(exc)
    replay.detach()
    return out


def test_a_layout_declared_for_another_rank_is_refused() -> None:
    """Cut by the declared layout, the input ids agree with the routes whatever rank the
    layout names: the layout itself is held against Megatron's parallel state."""
    for result in spawn(4, other_ranks, tp=2, cp=2):
        assert result["this rank"] is None
        assert result["this rank, alone"] is None
        for name in ("tp rank", "cp rank"):
            for case in (name, f"{name}, alone"):
                assert result[case] is not None
                assert "the layout is declared for Parallel(" in result[case]
        assert result["no sp"] is not None  # against the model's sequence_parallel
        assert "this process is Parallel(" in result["no sp"]


def test_a_token_check_that_never_ran_raises(model: Any) -> None:
    """A pipeline stage after the first: its model is given hidden states, not input
    ids, so no forward hands the check its tokens. Unless given `tokens=` (or built
    with `check_tokens=False`), the step raises instead of replaying unchecked."""
    tokens = torch.randint(0, 64, (B, S), generator=torch.Generator().manual_seed(5))
    routes = dataclasses.replace(packed_routes([S, S]), tokens=tokens.to(torch.int32))
    layout = TokenLayout.sbhd([S, S], seq_len=S)
    positions = torch.arange(S).expand_as(tokens)

    def later_stage() -> None:  # the decoder alone, as a later stage runs it
        hidden = model.embedding(input_ids=tokens, position_ids=positions)
        model.decoder(hidden_states=hidden, attention_mask=causal_mask(S))

    replay = MegatronReplay(model, SPEC)
    with (
        pytest.raises(InvalidRoutes, match=r"the token check did not run.*tokens="),
        torch.no_grad(),
        replay.micro_batch(routes, layout),
    ):
        later_stage()
    with torch.no_grad(), replay.micro_batch(routes, layout, tokens=tokens):
        later_stage()
    with torch.no_grad(), replay.micro_batch(routes, layout):
        forward(model, tokens)  # the first stage: its forward hands the check its ids
    replay.detach()
    unchecked = MegatronReplay(model, SPEC, check_tokens=False)
    with torch.no_grad(), unchecked.micro_batch(routes, layout):
        later_stage()
    unchecked.detach()


def test_a_stage_of_dense_layers_reads_nothing(model: Any, client: Client) -> None:
    client.create_namespace("dense-stage", SPEC)
    writes = [make_write(f"d{i}", SPEC, tokens=n) for i, n in enumerate((S, 5))]
    refs = [r.ref for r in client.put("dense-stage", writes)]
    with Client("http://127.0.0.1:9", KEYS["admin"]) as nowhere:  # nothing answers there
        for layout in ("padded", "packed"):
            routes = TrainerReader(nowhere, "dense-stage", layout=layout, layers=[]).fetch(refs)
            assert isinstance(routes, CompactRoutes)
            assert routes.lengths.tolist() == [S, 5]
            assert routes.origin.layers == ()
            assert routes.origin.trajectory_ids == ("d0", "d1")
        assert routes.cu_seqlens is not None
        assert routes.cu_seqlens.tolist() == [0, S, S + 5]
        wide = TrainerReader(nowhere, "dense-stage", layers=[], compact=False).fetch(refs)
        assert wide.ids.shape[:3] == (2, S, 0)
        with pytest.raises(ValueError, match="by route refs"):
            TrainerReader(nowhere, "dense-stage", layers=[]).fetch(["d0"])
        TrainerReader(nowhere, "dense-stage", layers=[], direct=True)  # nothing to fetch
    with pytest.raises(ValueError, match="a direct read fetches whole stored segments"):
        TrainerReader(client, "dense-stage", layers=[1], direct=True)
