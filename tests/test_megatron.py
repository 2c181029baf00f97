"""Replay through Megatron-Core's own RouterReplay, on CPU with real megatron-core.

Routes recorded by Megatron (RECORD) go through r3store and come back to be replayed
(REPLAY_FORWARD, REPLAY_BACKWARD under recomputation) into an identical routing map;
the token order of every parallel layout is checked against Megatron's own helpers in
real gloo process groups (sequence parallel, context parallel, both, packed sequences,
pipeline stages with virtual chunks and a dense first layer).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from http_helpers import KEYS, ServerProcess
from megatron_world import causal_mask, cpu_shims, quiet, spawn, tiny_config, tiny_gpt, world
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store_client import Client
from r3store_client.megatron import (
    MegatronReplay,
    Parallel,
    TokenLayout,
    gather_recorded,
)
from r3store_client.reader import TrainerReader
from r3store_client.tensors import RouteTensors

quiet()
SPEC = RouteSpec(num_layers=2, num_experts=8, top_k=2)  # the tiny model's two MoE layers
B, S = 2, 8


@pytest.fixture(scope="module")
def megatron() -> Iterator[None]:
    with cpu_shims(), world():
        yield


@pytest.fixture
def model(megatron: None) -> Any:
    torch.manual_seed(0)
    made = tiny_gpt(tiny_config())
    for p in made.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return made


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


def test_record_store_fetch_and_replay_exactly(model: Any, tmp_path: Path) -> None:
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

    server = ServerProcess(tmp_path, None)
    try:
        client = Client(server.url, KEYS["admin"])
        client.create_namespace("mg", SPEC)
        client.put("mg", [TrajectoryWrite(f"s{b}", S, topk=ids[b].numpy()) for b in range(B)])
        routes = TrainerReader(client, "mg").fetch(["s0", "s1"])
        client.close()
    finally:
        server.stop()

    with torch.no_grad():  # the trainer's routers drift away from the engine's
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight))
    maps.clear()
    with torch.no_grad():
        forward(model, tokens)
    assert any(not torch.equal(a, b) for a, b in zip(first, maps, strict=True)), "no drift"

    maps.clear()
    with replay.micro_batch(routes, layout) as step:
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
    layout = TokenLayout.sbhd([tokens.shape[1]] * tokens.shape[0], seq_len=tokens.shape[1])
    with torch.no_grad(), replay.record() as recorded:
        forward(model, tokens)
    ids, seen = gather_recorded(recorded, layout, replay.layers, SPEC)
    lengths = torch.tensor(layout.lengths, dtype=torch.int32)
    return RouteTensors(ids, seen[..., None].expand(ids.shape).clone(), lengths)


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
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight))
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
    with torch.no_grad():
        for router in replay.routers:
            router.weight.add_(torch.randn_like(router.weight))
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


# ---- parallel layouts, in real gloo worlds: Megatron's own helpers are the oracle


def _pairs(layout: TokenLayout) -> list[tuple[int, int]]:
    return list(zip(layout.sequence.tolist(), layout.token.tolist(), strict=True))


def sbhd_rank(lengths: list[int], seq: int, sequence_parallel: bool) -> dict[str, Any]:
    """What this rank's routers see of a `[b, s]` batch, by Megatron's helpers (the CP
    split of the batch, the `[s, b]` activations, the SP scatter), and by TokenLayout."""
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
    got = TokenLayout.sbhd(lengths, seq, Parallel.of_this_rank(sequence_parallel))
    return {"want": want, "got": _pairs(got)}


def thd_rank(lengths: list[int], padded: list[int], sequence_parallel: bool) -> dict[str, Any]:
    """The same for packed sequences: Megatron's CP split applied to each sequence's
    padded slot (`get_thd_batch_on_this_cp_rank` needs Transformer Engine; per sequence
    it is this split), then the SP scatter of the packed `[t, 1]` activations."""
    from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
    from megatron.core.utils import get_batch_on_this_cp_rank

    bounds = np.concatenate([[0], np.cumsum(padded)]).tolist()
    parts = []
    for i in range(len(lengths)):
        slot = torch.arange(bounds[i], bounds[i + 1], dtype=torch.float32)[None]
        parts.append(get_batch_on_this_cp_rank({"tokens": slot})["tokens"][0])
    activations = torch.cat(parts)[:, None]  # [t, 1]
    if sequence_parallel:
        activations = scatter_to_sequence_parallel_region(activations)
    want = []
    for p in activations.reshape(-1).long().tolist():
        i = int(np.searchsorted(bounds, p, side="right")) - 1
        j = p - bounds[i]
        want.append((i, j) if j < lengths[i] else (-1, -1))
    got = TokenLayout.thd(lengths, bounds, Parallel.of_this_rank(sequence_parallel))
    return {"want": want, "got": _pairs(got)}


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
        everything = [(i, j) for i, n in enumerate(counts) for j in range(n)]
        assert sorted(union) == everything  # every token on exactly one rank


def pipeline_rank(layer_pattern: list[int], vp: int | None) -> dict[str, Any]:
    """This stage's routers mapped to the routes' layers, beside the layers Megatron's
    offset helpers say the stage builds."""
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
    indices = replay.indices(
        RouteTensors(
            torch.zeros((1, 4, spec.num_layers, 2), dtype=torch.int32),
            torch.ones((1, 4, spec.num_layers, 2), dtype=torch.bool),
            torch.tensor([4], dtype=torch.int32),
        ),
        TokenLayout.sbhd([4], 4),
    )
    return {"got": replay.layers, "want": want, "loaded": len(indices)}


@pytest.mark.parametrize("vp", [None, 2], ids=["pp2", "pp2-vp2"])
def test_pipeline_stages_take_their_own_moe_layers(vp: int | None) -> None:
    pattern = [0, 1, 1, 0, 1, 1, 1, 1]  # a dense first layer, and one in the middle
    ranks = spawn(2, pipeline_rank, pattern, vp, pp=2, vp=vp)
    union = []
    for result in ranks:
        assert result["got"] == result["want"]
        assert result["loaded"] == len(result["got"])
        union += result["got"]
    assert sorted(union) == list(range(sum(pattern)))
