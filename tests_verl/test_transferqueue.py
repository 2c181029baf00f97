"""r3store as TransferQueue's storage backend, chosen by configuration, with the real
TransferQueue 0.1.11 on a local Ray cluster and verl 0.9.1's own code: the agent loop's
puts (`AgentLoopWorkerTQ._agent_loop_postprocess`) and the Megatron actor's read and
router replay (`ActorRolloutRefWorker.compute_log_prob`, `megatron_actor.py`). The
routes reach r3store and not SimpleStorage, and read back exactly as SimpleStorage gives
the same tensors."""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray
import torch
import transfer_queue as tq
import verl
from tensordict import TensorDict
from transfer_queue.storage.managers.base import StorageManagerFactory
from verl_rollout import EXPERTS, LAYERS, TOP_K

from r3store.errors import NotFound, RefMismatch
from r3store.refs import RouteRef
from r3store_client import Client
from r3store_client.transferqueue import NAME, R3StoreManager

ROUTES = "routed_experts"
COPY = "routes_through_simple_storage"  # the same tensors, as SimpleStorage keeps them


def routes(tokens: int, rng: np.random.Generator, recorded: int | None = None) -> torch.Tensor:
    """int16 `[tokens, L, K]` of distinct experts per token-layer, in the engine's
    order; rows past `recorded` zero (verl's rows without a route)."""
    ids = np.stack(
        [np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)]) for _ in range(tokens)]
    )
    if recorded is not None:
        ids[recorded:] = 0
    return torch.from_numpy(ids.astype(np.int16))


def conf(url: str, namespace: str) -> dict[str, Any]:
    spec = {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K}
    return {
        "backend": {
            "storage_backend": NAME,
            "SimpleStorage": {"num_data_storage_units": 1},
            NAME: {"url": url, "namespace": namespace, "spec": spec},
        }
    }


@pytest.fixture(scope="module")
def cluster() -> Iterator[str]:
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        yield ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def queue(cluster: str, server: str) -> Iterator[str]:
    """TransferQueue started with the backend chosen by name; the namespace it writes."""
    tq.init(conf(server, "tq"))
    try:
        yield "tq"
    finally:
        tq.close()


def test_the_entry_point_registers_the_backend() -> None:
    assert "r3store" in {ep.name for ep in verl_plugins()}
    assert StorageManagerFactory._registry[NAME] is R3StoreManager


def verl_plugins() -> Any:
    from importlib.metadata import entry_points

    return entry_points(group="verl.plugins")


def test_a_put_goes_to_r3store_and_reads_back_as_simple_storage_would(
    queue: str, server: str
) -> None:
    rng = np.random.default_rng(0)
    tensors = [routes(5, rng), routes(3, rng, recorded=2), routes(7, rng)]
    tokens = [torch.arange(len(t), dtype=torch.int64) + 10 * i for i, t in enumerate(tensors)]
    data = TensorDict(
        {
            ROUTES: torch.nested.as_nested_tensor(tensors, layout=torch.jagged),
            COPY: torch.nested.as_nested_tensor(tensors, layout=torch.jagged),
            "input_ids": torch.nested.as_nested_tensor(tokens, layout=torch.jagged),
        },
        batch_size=[3],
    )
    tags = [{"prompt_len": 2, "global_steps": 4}] * 3
    with Client(server) as client:
        before = stored(client, queue)
        tq.kv_batch_put(keys=["a", "b", "c"], partition_id="train", fields=data, tags=tags)
        assert stored(client, queue) == before + 3

    got = tq.kv_batch_get(keys=["c", "a", "b"], partition_id="train")
    mine, theirs = got[ROUTES], got[COPY]
    assert type(mine) is type(theirs)
    assert (mine.dtype, mine.layout, mine.is_nested) == (theirs.dtype, theirs.layout, True)
    assert torch.equal(mine.offsets(), theirs.offsets())
    assert torch.equal(mine.values(), theirs.values())
    for part, want in zip(mine.unbind(), [tensors[2], tensors[0], tensors[1]], strict=True):
        assert torch.equal(part, want)

    # only the samples asked for, each named by the ref the controller keeps
    one = tq.kv_batch_get(keys=["b"], partition_id="train", select_fields=[ROUTES])
    assert torch.equal(one[ROUTES].unbind()[0], tensors[1])
    meta = tq.get_client().kv_retrieve_meta(keys=["b"], partition_id="train")
    ref = RouteRef.from_json(meta._custom_backend_meta[0][ROUTES]["ref"])
    assert (ref.namespace, ref.num_tokens, ref.policy_version) == (queue, 3, 4)

    # and SimpleStorage holds none of them
    inner = tq.get_client().storage_manager.inner
    held = asyncio.run(inner.get_data(meta.select_fields([COPY])))
    assert torch.equal(held[COPY].unbind()[0], tensors[1])
    with pytest.raises(RuntimeError, match=f"field '{ROUTES}' not found"):
        asyncio.run(inner.get_data(meta.select_fields([ROUTES])))
    tq.kv_clear(keys=["a", "b", "c"], partition_id="train")


def stored(client: Client, namespace: str) -> int:
    """The trajectories r3store holds in `namespace` (made by the first put)."""
    try:
        return client.namespace(namespace).trajectories or 0
    except NotFound:
        return 0


def agent_loop_worker() -> Any:
    """verl's `AgentLoopWorkerTQ` (the class under its Ray actor), without its model:
    `verl.trainer.ppo.v1`'s package imports the trainer (torchdata, aiohttp), so the
    module is loaded from its file."""
    path = Path(verl.__file__).parent / "trainer/ppo/v1/agent_loop_tq.py"
    spec = importlib.util.spec_from_file_location("agent_loop_tq", path)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    cls = module.AgentLoopWorkerTQ.__ray_actor_class__
    worker = cls.__new__(cls)
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.processor = None
    return worker


def test_the_agent_loops_puts_replay_exactly_in_megatron(queue: str) -> None:
    """verl's agent loop puts each trajectory (int16 routes over prompt and response,
    zero rows past what the engine recorded); the trainer's `compute_log_prob` on verl's
    Megatron actor reads them (`tqbridge`), micro-batches them, and its engine's
    `forward_step` replays them (R3) into Megatron-Core's routers, which route every
    replayed token to the experts the engine chose; the log probs go back to
    TransferQueue."""
    from megatron_actor import MAX_TOKENS, megatron_actor
    from transfer_queue.metadata import KVBatchMeta
    from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

    rng = np.random.default_rng(1)
    worker = agent_loop_worker()
    engine_routes = {}
    token_ids = {}

    def output(prompt: int, response: int, recorded: int) -> AgentLoopOutput:
        ids = routes(recorded, rng)
        return AgentLoopOutput(
            prompt_ids=[int(t) for t in rng.integers(6, 120, prompt)],
            response_ids=[int(t) for t in rng.integers(6, 120, response)],
            response_mask=[1] * response,
            routed_experts=ids.tolist(),
            num_turns=2,
            metrics=AgentLoopMetrics(),
            extra_fields={"min_global_steps": 3, "max_global_steps": 3},
        )

    async def rollouts() -> None:
        for session, (p, r) in enumerate([(5, 4), (3, 6), (6, 2)]):
            out = output(p, r, p + r - 1)  # no route for the last sampled token
            key = f"g{session}_0_0"
            engine_routes[key] = out.routed_experts
            token_ids[key] = out.prompt_ids + out.response_ids
            await worker._agent_loop_postprocess(
                out, validate=False, uid=f"g{session}", session_id=0, global_steps=3
            )

    asyncio.run(rollouts())
    keys = list(engine_routes)
    got = tq.kv_batch_get(keys=keys, partition_id="train")
    for part, key in zip(got[ROUTES].unbind(), keys, strict=True):
        want = torch.zeros(part.shape, dtype=torch.int16)
        recorded = torch.tensor(engine_routes[key], dtype=torch.int16)
        want[: len(recorded)] = recorded
        assert part.dtype == torch.int16
        assert torch.equal(part, want)

    # the trainer's old-log-prob step (`_compute_old_log_prob`): the worker gets the meta
    extra = {"calculate_entropy": True, "compute_loss": False, "temperature": 1.0}
    meta = KVBatchMeta(keys=keys, tags=[{}] * len(keys), partition_id="train", extra_info=extra)
    with megatron_actor() as (actor, forwards):
        done = actor.compute_log_prob(meta)
    assert isinstance(done, KVBatchMeta)
    assert done.keys == keys

    # verl's dynamic batching: micro-batches of up to MAX_TOKENS, several sequences packed
    by_tokens = {tuple(ids): key for key, ids in token_ids.items()}
    assert len(forwards) == 2
    assert max(len(f.bounds) - 1 for f in forwards) == 2
    replayed = 0
    for forward in forwards:
        assert forward.bounds[-1] <= MAX_TOKENS
        assert len(forward.maps) == LAYERS
        for ids, maps in forward.sequences():
            key = by_tokens.pop(tuple(ids))
            recorded = np.asarray(engine_routes[key])  # [rows - 1, L, K]: the last is native
            for layer, used in enumerate(maps):
                want = torch.zeros(len(recorded), EXPERTS, dtype=torch.bool)
                want.scatter_(1, torch.from_numpy(recorded[:, layer]).long(), True)
                assert torch.equal(used[: len(recorded)], want)
                assert (used.sum(-1) == TOP_K).all()
            replayed += len(recorded)
    assert not by_tokens  # every trajectory went through the model once
    assert replayed == sum(len(r) for r in engine_routes.values())

    # the worker's log probs, written back to TransferQueue, one per token
    back = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["log_probs"])
    for part, key in zip(back["log_probs"].unbind(), keys, strict=True):
        assert part.shape == (len(token_ids[key]),)
        assert torch.isfinite(part).all()
    tq.kv_clear(keys=keys, partition_id="train")


def test_every_turn_of_verls_tool_agent_loop_is_kept(queue: str, client: Client) -> None:
    """verl's own `ToolAgentLoop`, three turns with tool calls, the weights updated
    between the second and the third: verl's loop keeps the last turn's routes only
    (zeros where the engine's prefix cache held earlier turns' tokens, a prefill's
    choice for the others); r3store's, the same loop with its server manager wrapped,
    keeps each turn's own rows, and through the backend each turn is a segment of its
    own with its weights' version, read back whole."""
    from tool_agent import Engine, run, tokenizer, tool_call
    from verl.experimental.agent_loop.tool_agent_loop import ToolAgentLoop as VerlLoop

    from r3store_client.turn_routes import TURNS_FIELD
    from r3store_client.verl_turns import ToolAgentLoop

    def engine() -> Engine:
        replies = [tool_call(2, 3), tool_call(5, 10), "The answer is 15.<|im_end|>"]
        return Engine(tokenizer(), replies, [3, 3, 4], LAYERS, EXPERTS, TOP_K)

    theirs, ours = engine(), engine()
    verl_out = asyncio.run(run(VerlLoop, theirs))
    out = asyncio.run(run(ToolAgentLoop, ours))
    assert [c[:2] for c in ours.calls] == [c[:2] for c in theirs.calls]  # the same rollout
    assert len(ours.calls) == 3
    truth = np.concatenate(ours.own)  # the rows each token was first computed with
    total = len(out.prompt_ids) + len(out.response_ids)
    assert truth.shape == (total - 1, LAYERS, TOP_K)
    kept = np.asarray(verl_out.routed_experts)
    assert np.array_equal(kept, theirs.calls[-1][2])  # verl: the last call's answer only
    assert not np.array_equal(kept, np.concatenate(theirs.own))
    assert (kept[:16] == 0).all()  # a prefix-cache hit: no routes for the prompt at all
    assert np.array_equal(np.asarray(out.routed_experts), truth)
    first, second = ours.calls[0], ours.calls[1]
    starts = [0, first[0] + first[1] - 1, second[0] + second[1] - 1]
    assert out.extra_fields[TURNS_FIELD] == {"starts": starts, "policy_versions": [3, 3, 4]}

    worker = agent_loop_worker()
    before = stored(client, queue)
    asyncio.run(
        worker._agent_loop_postprocess(out, validate=False, uid="mt", session_id=0, global_steps=4)
    )
    assert stored(client, queue) == before + 1
    [got] = tq.kv_batch_get(keys=["mt_0_0"], partition_id="train")[ROUTES].unbind()
    want = torch.zeros((total, LAYERS, TOP_K), dtype=torch.int16)
    want[: total - 1] = torch.from_numpy(truth.astype(np.int16))
    assert torch.equal(got, want)
    meta = tq.get_client().kv_retrieve_meta(keys=["mt_0_0"], partition_id="train")
    ref = RouteRef.from_json(meta._custom_backend_meta[0][ROUTES]["ref"])
    ends = [*starts[1:], total]
    assert ref.segments == tuple((a, b - a) for a, b in zip(starts, ends, strict=True))
    assert ref.policy_version == 3  # the oldest turn's
    [item] = client.get_batch(queue, [ref.trajectory_id]).items
    assert item is not None
    assert [(s.start, s.num_tokens, s.policy_version) for s in item.segments] == [
        (a, b - a, v) for a, b, v in zip(starts, ends, [3, 3, 4], strict=True)
    ]
    tq.kv_clear(keys=["mt_0_0"], partition_id="train")


def test_a_tampered_ref_is_refused(queue: str) -> None:
    rng = np.random.default_rng(2)
    data = TensorDict({ROUTES: routes(4, rng)[None]}, batch_size=[1])
    tq.kv_batch_put(keys=["t"], partition_id="train", fields=data)
    client = tq.get_client()
    meta = client.kv_retrieve_meta(keys=["t"], partition_id="train")
    value = dict(meta._custom_backend_meta[0][ROUTES])
    ref = RouteRef.from_json(value["ref"])
    value["ref"] = dataclasses.replace(ref, digest="0" * len(ref.digest)).to_json()
    schema = {ROUTES: meta.field_schema[ROUTES]}
    manager = client.storage_manager.inner
    altered = {meta.global_indexes[0]: {ROUTES: value}}
    asyncio.run(manager.notify_data_update("train", meta.global_indexes, schema, altered))
    with pytest.raises(RefMismatch, match="the ref was altered"):
        tq.kv_batch_get(keys=["t"], partition_id="train")
    tq.kv_clear(keys=["t"], partition_id="train")


def run_python(code: str, gcs: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "RAY_ADDRESS": gcs, **env},
        capture_output=True,
        text=True,
        timeout=240,
    )


ATTACH = "import ray; ray.init(address='auto'); import verl, transfer_queue as tq; tq.init()"


def test_a_process_without_the_plugin_fails_loudly(queue: str, cluster: str) -> None:
    """A verl process that did not load the plugin (here: plugins turned off) stops at
    `tq.init`, naming the backend; never runs on another one."""
    done = run_python(ATTACH, cluster, VERL_USE_EXTERNAL_PLUGINS="none")
    assert done.returncode != 0
    assert f"Unknown manager_type: {NAME}" in done.stderr


def test_a_plugin_that_fails_to_import_says_so(queue: str, cluster: str) -> None:
    """The backend's import fails (a dependency of it missing): verl would log that at
    debug level; here the process logs it as an error and `tq.init` raises, naming
    r3store and what failed."""
    broken = "import sys; sys.modules['r3store_client.tq_samples'] = None; " + ATTACH
    done = run_python(broken, cluster)
    assert done.returncode != 0
    assert "r3store's TransferQueue backend 'R3Store'" in done.stderr
    assert "could not be imported" in done.stderr
    assert "r3store_client.tq_samples" in done.stderr


def test_a_checkpoint_gives_the_same_routes_after_a_restart(
    queue: str, server: str, tmp_path: Path
) -> None:
    """Checkpoint, consume (clear), lose everything TransferQueue held (close it), start
    again and load the checkpoint: every sample reads the same routes, bit for bit, and
    r3store counts them unconsumed again."""
    rng = np.random.default_rng(3)
    tensors = [routes(n, rng) for n in (6, 2, 9)]
    data = TensorDict(
        {ROUTES: torch.nested.as_nested_tensor(tensors, layout=torch.jagged)}, batch_size=[3]
    )
    keys = ["k0", "k1", "k2"]
    tq.kv_batch_put(keys=keys, partition_id="train", fields=data)
    where = tmp_path / "global_step_1" / "transfer_queue"
    tq.save_checkpoint(str(where), metadata={"global_steps": 1})
    tq.kv_clear(keys=keys, partition_id="train")
    manager = tq.get_client().storage_manager
    opened = list(manager._clients.values())
    assert opened  # the sync API's loop's, at least
    tq.close()  # closes what the backend opened, though TransferQueue's loop has ended
    assert all(c._http is None and c._cpu is None for c in opened)
    assert not manager._clients
    tq.init(conf(server, queue))
    tq.load_checkpoint(str(where))
    got = tq.kv_batch_get(keys=keys, partition_id="train")
    for part, want in zip(got[ROUTES].unbind(), tensors, strict=True):
        assert torch.equal(part, want)
    record = json.loads((where / "r3store.json").read_text())
    with Client(server) as client:
        epoch, kept = client.checkpoints(queue)
    assert record["step"] in {c.step for c in kept}
    assert epoch >= 1  # resumed there
    tq.kv_clear(keys=keys, partition_id="train")
