"""r3store in verl 0.9.1's R3 path, with verl's own code on both sides and a real r3store
server over HTTP.

Rollout: verl's `AgentLoopWorker.generate_sequences` (its `SingleTurnAgentLoop`, padding
and batching) builds the batch with `routed_experts` by value; a worker that stores them
(`store_routes`) sends refs instead. Trainer: the refs resolve into the tensor verl would
have carried (`resolve_routes`), and per data-parallel rank into the jagged tensor of
verl's no-padding batch (`resolve_nested`), which verl's own Megatron replay
(`align_r3_router_replay_data`, `build_r3_replay_mask`, `set_router_replay_data`) feeds
to the routers of a real Megatron-Core MoE that then routes every replayed token to the
stored experts. Only the rollout server (vLLM/SGLang, GPU-only) is stood in for.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import numpy as np
import pytest
import torch
from verl_rollout import (
    EXPERTS,
    LAYERS,
    TOP_K,
    Engine,
    clone,
    generate,
    make_namespace,
    prompts,
    worker,
)

from r3store.errors import RefMismatch
from r3store_client import AsyncClient, Client
from r3store_client.token_check import TokenMismatch
from r3store_client.verl import (
    REFS_KEY,
    ROUTES_KEY,
    refs_of,
    resolve_nested,
    resolve_routes,
    route_writes,
    store_routes,
    store_routes_async,
)


def by_value(groups: int = 4, n: int = 2, short: int = 0, step: int = 0) -> Any:
    """The batch verl's agent loop worker returns, routes by value."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    return generate(worker(AgentLoopWorker, Engine(short)), prompts(groups, n, step))


def r3_worker_class() -> type[Any]:
    """The rollout side's recipe: an agent loop worker that stores its batch's routes in
    r3store and returns refs in their place."""
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    class R3AgentLoopWorker(AgentLoopWorker):  # type: ignore[misc]
        r3_client: Client
        r3_namespace: str

        async def generate_sequences(self, batch: Any) -> Any:
            out = await super().generate_sequences(batch)
            await self.r3_store(out, int(batch.meta_info.get("global_steps", 0)))
            return out

        async def r3_store(self, out: Any, step: int) -> None:
            """Store the routes of `out` (from policy version `step`), refs in their place."""
            await asyncio.to_thread(
                store_routes, out, self.r3_client, self.r3_namespace, policy_version=step
            )

    return R3AgentLoopWorker


def r3_async_worker_class() -> type[Any]:
    """The same with the asyncio client, on the worker's own event loop."""

    class R3AsyncAgentLoopWorker(r3_worker_class()):  # type: ignore[misc]
        r3_url: str

        async def r3_store(self, out: Any, step: int) -> None:
            async with AsyncClient(self.r3_url) as client:
                await store_routes_async(out, client, self.r3_namespace, policy_version=step)

    return R3AsyncAgentLoopWorker


def with_refs(client: Client, namespace: str, groups: int = 4, n: int = 2, short: int = 0) -> Any:
    w = worker(r3_worker_class(), Engine(short), r3_client=client, r3_namespace=namespace)
    return generate(w, prompts(groups, n))


def test_the_agent_loop_batch_is_verls_layout() -> None:
    """What the integration unpads: verl's int16 `(bs, prompt+response, L, K)` routes at
    each sample's tokens (prompt left-padded, response right-padded), zeros elsewhere."""
    data = by_value()
    routes, mask = data.batch[ROUTES_KEY], data.batch["attention_mask"]
    assert routes.dtype == torch.int16
    assert tuple(routes.shape) == (8, 28, LAYERS, TOP_K)
    assert not routes[~mask.bool()].any()  # nothing on padding
    left = (mask[:, 0] == 0).sum()
    assert left > 0  # some prompts are left-padded
    unrouted_last = 0
    for i in range(len(data)):
        real = routes[i, mask[i].bool()]
        # every token fed through the engine has K distinct experts; the last sampled one
        # has none, unless the response was cut at response_length (its routes too)
        assert (real[:-1].sort(-1).values.diff(dim=-1) > 0).all()
        unrouted_last += int(not real[-1].any())
    assert 0 < unrouted_last < len(data)


def test_refs_resolve_to_verls_tensor_bit_for_bit(client: Client, namespace: str) -> None:
    expected = by_value()
    data = with_refs(client, namespace)
    assert ROUTES_KEY not in data.batch
    column = data.non_tensor_batch[REFS_KEY]
    assert column.dtype == object
    assert column.shape == (len(expected),)
    refs = refs_of(data)
    assert all(len(text) < 600 for text in column)
    assert [r.trajectory_id for r in refs] == [
        f"step0-prompt{g}/{k}" for g in range(4) for k in range(2)
    ]
    lengths = expected.batch["attention_mask"].sum(-1).tolist()
    assert [r.num_tokens for r in refs] == lengths
    assert {r.namespace for r in refs} == {namespace}
    # the same samples as verl's own run, token for token
    assert torch.equal(data.batch["input_ids"], expected.batch["input_ids"])

    resolved = resolve_routes(data, client)
    assert resolved.dtype == torch.int16
    assert resolved.shape == expected.batch[ROUTES_KEY].shape
    assert torch.equal(resolved, expected.batch[ROUTES_KEY])
    assert data.batch[ROUTES_KEY] is resolved

    stored = client.token_ids(namespace, [r.trajectory_id for r in refs])
    for i, ref in enumerate(refs):
        mask = expected.batch["attention_mask"][i].bool()
        want = expected.batch["input_ids"][i, mask].numpy()
        np.testing.assert_array_equal(stored[ref.trajectory_id], want)


def test_the_asyncio_worker_stores_the_same(client: Client, server: str, namespace: str) -> None:
    expected = by_value(step=3)
    w = worker(r3_async_worker_class(), Engine(), r3_url=server, r3_namespace=namespace)
    data = generate(w, prompts(4, 2, step=3))
    refs = refs_of(data)
    assert ROUTES_KEY not in data.batch
    assert {r.policy_version for r in refs} == {3}
    assert refs[0].trajectory_id == "step3-prompt0/0"
    assert torch.equal(resolve_routes(data, client), expected.batch[ROUTES_KEY])
    stored = client.get_batch(namespace, [r.trajectory_id for r in refs])
    prompt_lens = expected.batch["attention_mask"][:, : expected.batch["prompts"].shape[1]].sum(-1)
    assert [t.prompt_len for t in stored.found] == prompt_lens.tolist()
    assert [t.group_id for t in stored.found] == [f"step3-prompt{i // 2}" for i in range(8)]
    assert [t.policy_version for t in stored.found] == [3] * 8


def test_routes_recorded_for_fewer_tokens(client: Client, namespace: str) -> None:
    """Rows the engine did not record (verl leaves them zero) are stored as no route and
    come back as zeros."""
    expected = by_value(short=3)
    data = with_refs(client, namespace, short=3)
    mask = expected.batch["attention_mask"].bool()
    routes = expected.batch[ROUTES_KEY]
    unrouted = [int((~routes[i, mask[i]].any(-1).any(-1)).sum()) for i in range(len(expected))]
    assert max(unrouted) == 4
    assert len(set(unrouted)) > 1
    assert torch.equal(resolve_routes(data, client), expected.batch[ROUTES_KEY])


def test_reordered_split_and_concatenated_batches_stay_aligned(
    client: Client, namespace: str
) -> None:
    """The refs travel in `non_tensor_batch` through what the trainer does to the batch:
    `reorder` (balance_batch), `chunk` and `concat`, `union`."""
    from verl.protocol import DataProto

    expected = by_value()
    data = with_refs(client, namespace)
    order = torch.tensor([5, 2, 7, 0, 3, 6, 1, 4])
    expected.reorder(order)
    data.reorder(order)
    parts = data.chunk(4)
    resolved = [resolve_routes(p, client) for p in parts[::-1]][::-1]
    assert torch.equal(torch.cat(resolved), expected.batch[ROUTES_KEY])
    joined = DataProto.concat(parts)
    extra = DataProto.from_dict(tensors={"old_log_probs": torch.zeros(8, 12)})
    joined = joined.union(extra)
    assert torch.equal(resolve_routes(joined, client), expected.batch[ROUTES_KEY])


def test_each_rank_resolves_its_chunk_of_the_no_padding_batch(
    client: Client, namespace: str
) -> None:
    """The driver's `to_tensordict` and `left_right_2_no_padding` carry the refs; each
    data-parallel rank's chunk (verl's `chunk_tensordict`, as its dispatch splits) resolves
    to exactly the jagged routes verl's own conversion makes from the dense tensor."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    expected = left_right_2_no_padding(by_value().to_tensordict())
    data = left_right_2_no_padding(with_refs(client, namespace).to_tensordict())
    assert ROUTES_KEY not in data
    want_chunks = tu.chunk_tensordict(expected, 4)
    for rank, chunk in enumerate(tu.chunk_tensordict(data, 4)):
        want = want_chunks[rank][ROUTES_KEY]
        got = resolve_nested(chunk, client)
        assert got.is_nested
        assert got.dtype == torch.int16
        assert len(refs_of(chunk)) == 2
        assert torch.equal(got.offsets(), want.offsets())
        assert torch.equal(got.values(), want.values())
        for a, b in zip(got.unbind(), want.unbind(), strict=True):
            assert torch.equal(a, b)


def test_unordered_namespace_gives_the_same_expert_sets(client: Client) -> None:
    namespace = make_namespace(client, ordered=False)
    expected = by_value()
    data = with_refs(client, namespace)
    resolved = resolve_routes(data, client)
    want = expected.batch[ROUTES_KEY]
    assert not torch.equal(resolved, want)  # the engine's order is not kept...
    assert torch.equal(resolved, want.sort(-1).values)  # ...its experts are


def test_a_batch_that_is_not_the_refs_is_refused(client: Client, namespace: str) -> None:
    data = with_refs(client, namespace)
    swapped = clone(data)
    swapped.batch["input_ids"][3, -1 - int((swapped.batch["attention_mask"][3] == 0).sum())] = 7
    with pytest.raises(TokenMismatch, match="step0-prompt1/1"):
        resolve_routes(swapped, client)
    # the refs of one sample given to another: other lengths or other tokens
    crossed = clone(data)
    column = crossed.non_tensor_batch[REFS_KEY]
    column[[0, 6]] = column[[6, 0]]
    with pytest.raises(TokenMismatch, match=r"step0-prompt(0/0|3/0)"):
        resolve_routes(crossed, client)


def test_a_ref_that_no_longer_names_its_routes_is_refused(client: Client, namespace: str) -> None:
    data = with_refs(client, namespace)
    column = data.non_tensor_batch[REFS_KEY]
    ref = json.loads(column[2])
    ref["digest"] = ("0" if ref["digest"][0] != "0" else "1") + ref["digest"][1:]
    column[2] = json.dumps(ref)
    with pytest.raises(RefMismatch, match="step0-prompt1/0"):
        resolve_routes(data, client)


def test_clear_errors_on_batches_without_routes_or_refs(client: Client) -> None:
    data = by_value(groups=1)
    with pytest.raises(KeyError, match=REFS_KEY):
        resolve_routes(data, client)
    data.batch.pop(ROUTES_KEY)
    with pytest.raises(KeyError, match="rollout routing replay"):
        route_writes(data, policy_version=0)
    nameless = by_value(groups=1)
    nameless.non_tensor_batch.pop("uid")
    with pytest.raises(ValueError, match="trajectory_ids"):
        route_writes(nameless, policy_version=0)
    writes = route_writes(nameless, policy_version=3, trajectory_ids=["a", "b"])
    assert [(w.trajectory_id, w.policy_version, w.group_id) for w in writes] == [
        ("a", 3, None),
        ("b", 3, None),
    ]


# The trainer's replay: verl's Megatron router replay on a real Megatron-Core MoE (CPU)


def _replay_in_megatron(
    chunk: Any,
) -> tuple[list[torch.Tensor], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    """Feed one rank's no-padding batch through verl's R3 replay path into a tiny
    Megatron-Core GPT MoE (gloo world of one: tp = pp = cp = 1) and run its forward in
    REPLAY_FORWARD, then without replay; returns each MoE router's replay target, its
    routing map (rows x experts) with replay and without, and the replay mask."""
    from megatron.core.transformer.moe.router import TopKRouter
    from verl.models.mcore.util import preprocess_thd_engine
    from verl.utils.megatron import router_replay_utils
    from verl.utils.megatron.router_replay_patch import (
        RouterReplay,
        RouterReplayAction,
        apply_router_replay_patch,
    )

    import megatron_world

    input_ids = chunk["input_ids"]
    with megatron_world.cpu_shims(), megatron_world.world():
        apply_router_replay_patch()
        config = megatron_world.tiny_config(
            moe_enable_routing_replay=False, enable_routing_replay=True
        )
        torch.manual_seed(0)
        model = megatron_world.tiny_gpt(config, vocab=128, seq=256).eval()
        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        assert len(routers) == LAYERS
        assert all(r.router_replay is not None for r in routers)
        # verl's device name is "cuda" on a machine without an accelerator (it has no CPU
        # platform); the replay's tensors are moved to it
        saved = router_replay_utils.device_name
        router_replay_utils.device_name = "cpu"
        try:
            RouterReplay.set_global_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
            # MegatronEngineWithLMHead.forward_step, R3 mode
            layers_topk_idx = router_replay_utils.align_r3_router_replay_data(
                chunk[ROUTES_KEY], input_ids
            )
            replay_mask = router_replay_utils.build_r3_replay_mask(
                input_ids, chunk["response_mask"]
            )
            router_replay_utils.set_router_replay_data(
                layers_topk_idx, None, config, 0, replay_mask=replay_mask, model=model
            )
        finally:
            router_replay_utils.device_name = saved
        targets = [r.router_replay.target_topk_idx.clone() for r in routers]
        mask = routers[0].router_replay.target_replay_mask.clone()
        packed, _, _ = preprocess_thd_engine(input_ids, pre_process=True)

        def forward() -> list[torch.Tensor]:
            maps: list[torch.Tensor] = []
            hooks = [
                r.register_forward_hook(lambda _m, _i, out: maps.append(out[1].detach().clone()))
                for r in routers
            ]
            rows = packed.shape[1]
            with torch.no_grad():
                model(
                    packed,
                    torch.arange(rows)[None],
                    attention_mask=megatron_world.causal_mask(rows),
                )
            for h in hooks:
                h.remove()
            return maps

        used = forward()
        RouterReplay.clear_global_indices()
        RouterReplay.clear_global_router_replay_action()
        native = forward()  # the model's own routing of the same rows
    return targets, used, native, mask


def test_megatron_routers_replay_the_resolved_routes(client: Client, namespace: str) -> None:
    """One rank's resolved chunk through verl's replay into Megatron's routers: each
    replayed row is routed to the experts verl's by-value batch holds for that token."""
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    expected = tu.chunk_tensordict(left_right_2_no_padding(by_value().to_tensordict()), 2)[1]
    data = left_right_2_no_padding(with_refs(client, namespace).to_tensordict())
    chunk = tu.chunk_tensordict(data, 2)[1]  # rank 1 of 2
    resolve_nested(chunk, client)
    targets, used, native, mask = _replay_in_megatron(chunk)

    routes = expected[ROUTES_KEY]
    lengths = routes.offsets().diff().tolist()
    values = routes.values()  # [tokens, L, K], the rank's samples back to back
    n = values.shape[0]
    last = np.cumsum(lengths) - 1  # each sample's final token: left to the router
    assert mask.shape == (n,)
    assert not mask[last].any()
    assert int(mask.sum()) == n - len(lengths)
    replayed = mask.bool()
    for layer in range(LAYERS):
        assert torch.equal(targets[layer], values[:, layer].long())
        want = torch.zeros(n, EXPERTS, dtype=torch.bool)
        want.scatter_(1, values[:, layer].long(), True)
        assert used[layer].shape == (n, EXPERTS)
        assert torch.equal(used[layer][replayed], want[replayed])
        assert (used[layer].sum(-1) == TOP_K).all()
        assert torch.equal(used[layer][~replayed], native[layer][~replayed])
        # the model alone routes most rows elsewhere: the replay is what put them there
        assert (native[layer][replayed] != want[replayed]).any(-1).float().mean() > 0.5
