"""Route refs through a real local Ray cluster, against a real r3store server process.

Rollout actors (async Ray actors) write a GRPO step's routes with the asyncio client,
some trajectories turn by turn, and return route refs; the driver moves only those refs
(a few hundred bytes each) to two trainer actors, each of which resolves its own
data-parallel slice (`rank_slice`) from r3store and replays it in the tiny HF Qwen3-MoE
of `hf_tiny.py` (routers perturbed so that they disagree with the written routes):
every MoE layer runs exactly the experts written for every token. A ref altered on
the way (digest, segments, trajectory) raises `RefMismatch` in the trainer actor, which
goes on serving good refs.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import pickle
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
import ray

from http_helpers import KEYS, ServerProcess
from r3store.errors import RefMismatch
from r3store.records import TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parent
NAMESPACE = "rayrun"
SPEC = RouteSpec(2, 4, 2)  # the tiny Qwen3-MoE: 2 MoE layers, top-2 of 4 experts
PROMPT = 5
WORLD = 2
MAX_REF_BYTES = 400  # a ref as Ray pickles it, whatever its trajectory's length


def written(tid: str) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32], list[int]]:
    """The routes `[n, L, K]`, token ids and turn boundaries a rollout writes for `tid`:
    drawn from the id alone, so the driver knows them without being sent them. Samples
    with an odd index have two turns."""
    rng = np.random.default_rng(zlib.crc32(tid.encode()))
    n = int(rng.integers(PROMPT + 2, 40))
    scores = rng.random((n, SPEC.num_layers, SPEC.num_experts))
    routes = np.argsort(scores, axis=-1)[..., : SPEC.top_k].astype(np.int32)
    tokens = rng.integers(2, 128, n).astype(np.int32)
    cuts = [0, n // 2, n] if int(tid.rsplit("s", 1)[1]) % 2 else [0, n]
    return routes, tokens, cuts


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout worker: an asyncio loop writing each finished trajectory (turn by turn
    for multi-turn samples) and answering with route refs only."""

    def __init__(self, url: str) -> None:
        self.url = url

    async def step(self, version: int, prompts: list[int], samples: int) -> list[RouteRef]:
        from r3store_client import AsyncClient, AsyncRolloutWriter

        async with (
            AsyncClient(self.url, api_key=KEYS["writer"]) as client,
            AsyncRolloutWriter(client, NAMESPACE) as writer,
        ):

            async def trajectory(prompt: int, sample: int) -> RouteRef:
                tid = f"step{version}/p{prompt}/s{sample}"
                routes, tokens, cuts = written(tid)
                turns = []
                for start, end in itertools.pairwise(cuts):
                    first = start == 0
                    write = TrajectoryWrite(
                        tid,
                        end - start,
                        topk=routes[start:end],
                        prompt_len=PROMPT if first else 0,
                        group_id=f"step{version}/p{prompt}" if first else None,
                        policy_version=version,
                        start=start,
                        token_ids=tokens[start:end],
                    )
                    turns.append(await writer.put(write))  # the next turn after the ack
                return RouteRef.joined(turns) if len(turns) > 1 else turns[0]

            return list(
                await asyncio.gather(*(trajectory(p, s) for p in prompts for s in range(samples)))
            )


@ray.remote(num_cpus=0)
class Trainer:
    """A data-parallel trainer rank with its own replica of the tiny model."""

    def __init__(self, url: str, rank: int, world_size: int) -> None:
        import torch
        import transformers
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING

        from hf_tiny import COMMON, TINY
        from r3store_client import Client
        from r3store_client.replay import RouterReplay

        torch.set_num_threads(1)
        model_type, auto, router, kwargs = TINY["qwen3_moe"]
        torch.manual_seed(0)
        model = getattr(transformers, auto).from_config(
            CONFIG_MAPPING[model_type](**{**COMMON, **kwargs})
        )
        with torch.no_grad():  # routers with opinions of their own
            for module in model.modules():
                if type(module).__name__ == router:
                    for p in module.parameters():
                        p.normal_(0.0, 0.5)
        self.model = model.eval()
        self.replayer = RouterReplay(self.model, SPEC)
        self.client = Client(url, api_key=KEYS["trainer"])
        self.rank, self.world_size = rank, world_size

    def replay(self, refs: list[RouteRef]) -> dict[str, Any]:
        """Resolve this rank's slice of `refs` and replay it: the experts each MoE layer
        ran for each of its trajectories' tokens."""
        import torch

        from r3store_client.tensors import padded, rank_slice

        mine = rank_slice(refs, self.rank, self.world_size)
        spec, batch = self.client.resolve(mine)
        routes = padded(batch, spec)
        assert routes.tokens is not None
        input_ids = routes.tokens.clamp(min=0).long()  # the batch the rollout made
        chosen: list[torch.Tensor] = []
        hooks = [
            r.register_forward_hook(lambda _m, _i, out: chosen.append(out[2].clone()))
            for r in self.replayer.routers
        ]
        try:
            with torch.no_grad(), self.replayer.replay(routes):
                self.model(input_ids=input_ids)
        finally:
            for hook in hooks:
                hook.remove()
        b, t = input_ids.shape
        ran = torch.stack([c.reshape(b, t, -1) for c in chosen], dim=2)  # [B, T, L, K]
        lengths = routes.lengths.tolist()
        return {
            "ids": [ref.trajectory_id for ref in mine],
            "ran": {ref.trajectory_id: ran[i, : lengths[i]].numpy() for i, ref in enumerate(mine)},
            "agreement": list(self.replayer.agreement),
        }


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    from r3store_client import Client

    process = ServerProcess(tmp_path_factory.mktemp("ray-r3store"), None)
    try:
        with Client(process.url, api_key=KEYS["admin"]) as admin:
            admin.create_namespace(NAMESPACE, SPEC)
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    """A local Ray cluster of 2 CPUs, quick to start in a sandbox; shut down whatever
    happens. Its workers import this module (the actors) and `hf_tiny`."""
    with pytest.MonkeyPatch.context() as env:
        env.setenv("RAY_AUTH_MODE", "disabled")  # loopback only; no token written to ~/.ray
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        path = os.pathsep.join([str(TESTS), str(TESTS.parent)])
        ray.init(
            num_cpus=2,
            object_store_memory=128 << 20,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": {"PYTHONPATH": path}},
        )
        try:
            yield
        finally:
            ray.shutdown()


@pytest.fixture(scope="module")
def step(server: ServerProcess, cluster: None) -> tuple[list[RouteRef], list[Any]]:
    """One GRPO step written by two rollout actors: its refs, in the order the driver
    hands them out, and the two trainer actors."""
    rollouts = [Rollout.remote(server.url) for _ in range(2)]  # type: ignore[attr-defined]
    trainers = [
        Trainer.remote(server.url, rank, WORLD)  # type: ignore[attr-defined]
        for rank in range(WORLD)
    ]
    answers = ray.get([r.step.remote(3, [2 * i, 2 * i + 1], 3) for i, r in enumerate(rollouts)])
    refs = [ref for answer in answers for ref in answer]
    return refs, trainers


def test_trainer_ranks_replay_exactly_the_routes_the_rollouts_wrote(
    step: tuple[list[RouteRef], list[Any]],
) -> None:
    from r3store_client.tensors import rank_slice

    refs, trainers = step
    ids = [f"step3/p{p}/s{s}" for p in range(4) for s in range(3)]
    # what crossed from the rollouts to the driver: refs, and nothing the size of routes
    assert all(type(ref) is RouteRef for ref in refs)
    assert [ref.trajectory_id for ref in refs] == ids
    for ref in refs:
        routes, _tokens, cuts = written(ref.trajectory_id)
        assert len(pickle.dumps(ref)) < MAX_REF_BYTES
        assert RouteRef.from_json(ref.to_json()) == ref
        assert ref.segments == tuple(zip(cuts[:-1], np.diff(cuts).tolist(), strict=True))
        assert (ref.num_tokens, ref.policy_version) == (routes.shape[0], 3)
    assert any(len(ref.segments) == 2 for ref in refs), "some samples are multi-turn"
    sent = len(pickle.dumps(refs))
    assert sent < MAX_REF_BYTES * len(refs)

    answers = ray.get([t.replay.remote(refs) for t in trainers])
    for rank, answer in enumerate(answers):  # each rank its own slice, nobody else's
        assert answer["ids"] == [r.trajectory_id for r in rank_slice(refs, rank, WORLD)]
        assert answer["ids"]
    assert [tid for answer in answers for tid in answer["ids"]] == ids
    for answer in answers:
        for tid, ran in answer["ran"].items():
            routes, _tokens, _cuts = written(tid)
            assert ran.shape == routes.shape, tid
            # the written experts as sets: the namespace keeps no top-k order
            np.testing.assert_array_equal(np.sort(ran, -1), np.sort(routes, -1), err_msg=tid)
    # the live routers disagreed with the written routes: replay made them run these
    assert min(a for answer in answers for a in answer["agreement"]) < 1.0


def test_an_altered_ref_raises_in_the_trainer_actor(
    step: tuple[list[RouteRef], list[Any]],
) -> None:
    refs, trainers = step
    two_turns = next(ref for ref in refs if len(ref.segments) == 2)
    one = refs[0]
    flipped = ("0" if one.digest[0] != "0" else "1") + one.digest[1:]
    altered = {
        "digest": (dataclasses.replace(one, digest=flipped), "digest"),
        "one turn under the joined digest": (
            dataclasses.replace(two_turns, segments=two_turns.segments[:1]),
            "digest",
        ),
        "cut otherwise": (
            dataclasses.replace(one, segments=((0, one.num_tokens - 1),)),
            "no longer stored as one segment",
        ),
        "another trajectory": (
            dataclasses.replace(one, trajectory_id="step3/p9/s0"),
            "no longer stored",
        ),
    }
    trainer = trainers[0]  # rank 0: a slice of a list of one is that one ref
    for what, (bad, why) in altered.items():
        with pytest.raises(RefMismatch, match=why) as raised:
            ray.get(trainer.replay.remote([bad]))
        assert f"ref {NAMESPACE}/{bad.trajectory_id}" in str(raised.value), what
    good = ray.get(trainer.replay.remote([one]))  # the actor goes on serving good refs
    assert good["ids"] == [one.trajectory_id]
