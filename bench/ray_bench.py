"""Route refs through Ray beside routes by value, per GRPO step, in one run.

A local Ray cluster (2 CPUs, no dashboard), one rollout actor holding a step's routes
(a Qwen3-30B-A3B-like spec, 48 MoE layers, top-8 of 128, uniform routes: the worst case
for r3store's compression) and N trainer actors. Three ways to hand the step's routes
from the rollout to the trainer ranks, each ending with every rank holding its own
`rank_slice` of the samples as torch tensors in host memory:

- route refs: the rollout wrote the step to r3store (its write is timed apart); it
  returns `RouteRef`s to the driver, which hands the list to every rank; each rank
  resolves its own slice from r3store (`Client.resolve`) into compact tensors.
- verl-style, by value: int16, a dense zero-padded `(1, total_length, L, K)` tensor per
  sample, concatenated into the batch's `(B, total_length, L, K)` tensor; the rollout
  returns the batch as `DataProto` pickles it by default (`torch.save` of its tensors)
  to the driver, which loads it, splits it by rank and sends each rank its chunk
  (`torch.save`d again), which the rank loads: two hops through Ray.
- slime-style, by value: a list of per-sample int32 `(num_tokens, L, K)` arrays, put
  into Ray's object store once and read whole by every rank (the broadcast slime did
  before #2385); each rank copies its own samples into tensors.

Bytes are what Ray's serializer makes of each hop's payload: what is put into Ray per
step (task arguments and answers; those over 100 KiB go through its object store), and
what the trainer ranks read out of it; with refs, the ranks also read the stored
(compressed) streams from r3store over HTTP, counted beside them.
Times are the driver's wall clock from the first call of a hand-off to every rank's
acknowledgement, medians over repeats, the three ways alternating within each repeat.
Each rank's checksum of the ids it holds must agree across the three ways.
"""

from __future__ import annotations

import asyncio
import io
import json
import os
import pickle
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import ray

from bench.figures import Figure
from r3store.records import TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store.testing.service import start_server, stop_server
from r3store.testing.synthetic import uniform_topk

KEY = "bench-admin-key-0123456789abcdef"
NAMESPACE = "raybench"
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Step:
    """One GRPO step: `groups` prompts of `prompt_len` tokens, `samples` responses each
    of `response` (low, high) tokens, padded by verl to `total_length`."""

    groups: int
    samples: int
    prompt_len: int
    response: tuple[int, int]
    total_length: int
    layers: int = 48
    experts: int = 128
    top_k: int = 8
    ranks: int = 2
    seed: int = 0

    @property
    def spec(self) -> RouteSpec:
        return RouteSpec(self.layers, self.experts, self.top_k)

    @property
    def size(self) -> int:
        return self.groups * self.samples


FULL = Step(groups=8, samples=8, prompt_len=1024, response=(256, 7168), total_length=8192)
QUICK = Step(groups=4, samples=4, prompt_len=256, response=(64, 1792), total_length=2048)


def carried(value: object) -> int:
    """Bytes Ray serializes `value` into, by Ray's own serializer (the driver's, once
    Ray is started); else pickle protocol 5 with large buffers out of band, as Ray
    pickles (about 30 bytes less an object: Ray's header)."""
    try:
        worker = ray._private.worker.global_worker
        context = worker.get_serialization_context()  # type: ignore[no-untyped-call]
        return int(context.serialize(value).total_bytes)
    except (AttributeError, ray.exceptions.RaySystemError):
        buffers: list[pickle.PickleBuffer] = []
        head = pickle.dumps(value, protocol=5, buffer_callback=buffers.append)
        return len(head) + sum(b.raw().nbytes for b in buffers)


@contextmanager
def local_cluster(object_store_bytes: int) -> Iterator[float]:
    """A local Ray cluster for this process, settings that make it start quickly and
    reliably in a sandbox; yields the seconds `ray.init` took. Shut down whatever
    happens."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # loopback only; no token in ~/.ray
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = time.perf_counter()
    ray.init(
        num_cpus=2,
        object_store_memory=object_store_bytes,
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}},
    )
    try:
        yield time.perf_counter() - started
    finally:
        ray.shutdown()


def _step_routes(step: Step) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.int32]]]:
    """Each sample's routes `[num_tokens, L, K]` uint8 and token ids; the samples of a
    prompt share its prompt's tokens and routes (prefix caching)."""
    rng = np.random.default_rng(step.seed)
    low, high = step.response
    routes, tokens = [], []
    for _group in range(step.groups):
        prompt = uniform_topk(rng, step.prompt_len, step.layers, step.experts, step.top_k, np.uint8)
        prompt_tokens = rng.integers(0, 150_000, step.prompt_len, dtype=np.int32)
        for _sample in range(step.samples):
            n = int(rng.integers(low, high + 1))
            response = uniform_topk(rng, n, step.layers, step.experts, step.top_k, np.uint8)
            routes.append(np.concatenate([prompt, response]))
            tokens.append(
                np.concatenate([prompt_tokens, rng.integers(0, 150_000, n, dtype=np.int32)])
            )
    return routes, tokens


def _rank_slice(items: Sequence[Any], rank: int, world_size: int) -> list[Any]:
    from r3store_client.tensors import rank_slice

    return rank_slice(items, rank, world_size)


@ray.remote(num_cpus=0)
class Rollout:
    """A rollout worker holding one step's routes, as the engine returned them."""

    def __init__(self, step: Step, url: str) -> None:
        self.step = step
        self.url = url
        self.routes, self.tokens = _step_routes(step)
        self.ids = [
            f"step0/p{i // step.samples}/s{i % step.samples}" for i in range(len(self.routes))
        ]
        self.refs: list[RouteRef] = []
        self.held: Any = None

    def token_layers(self) -> int:
        return sum(int(r.shape[0]) for r in self.routes) * self.step.layers

    async def write(self) -> float:
        """Store the step in r3store as an asyncio rollout loop does, each sample put
        as it finishes (all at once here); the seconds it took."""
        from r3store_client import AsyncClient, AsyncRolloutWriter

        step = self.step
        writes = [
            TrajectoryWrite(
                tid,
                routes.shape[0],
                topk=routes,
                prompt_len=step.prompt_len,
                group_id=tid.rsplit("/", 1)[0],
                token_ids=tokens,
            )
            for tid, routes, tokens in zip(self.ids, self.routes, self.tokens, strict=True)
        ]
        async with AsyncClient(self.url, api_key=KEY) as client:
            await client.ensure_namespace(NAMESPACE, step.spec)
            started = time.perf_counter()
            async with AsyncRolloutWriter(client, NAMESPACE) as writer:
                self.refs = list(await asyncio.gather(*(writer.put(w) for w in writes)))
            seconds = time.perf_counter() - started
        assert [ref.trajectory_id for ref in self.refs] == self.ids
        return seconds

    def prepare(self, way: str) -> None:
        """Make the step's routes as `way` holds them (the others are dropped)."""
        import torch

        self.held = None
        if way == "verl":
            step = self.step
            batch = torch.zeros(
                (len(self.routes), step.total_length, step.layers, step.top_k), dtype=torch.int16
            )
            for b, routes in enumerate(self.routes):
                batch[b, : routes.shape[0]] = torch.from_numpy(routes)
            self.held = batch
        elif way == "slime":
            self.held = [routes.astype(np.int32) for routes in self.routes]

    def get_refs(self) -> list[RouteRef]:
        return self.refs

    def verl_batch(self) -> bytes:
        """The batch as `DataProto.__getstate__` makes it by default."""
        import torch

        buffer = io.BytesIO()
        torch.save({"routed_experts": self.held}, buffer)
        return buffer.getvalue()

    def slime_data(self) -> list[npt.NDArray[np.int32]]:
        held: list[npt.NDArray[np.int32]] = self.held
        return held


@ray.remote(num_cpus=0)
class Trainer:
    """One data-parallel trainer rank; keeps what it was handed until `checksum`."""

    def __init__(self, rank: int, world_size: int, url: str) -> None:
        import torch

        from r3store_client import Client

        torch.set_num_threads(1)
        self.rank, self.world_size = rank, world_size
        self.client = Client(url, api_key=KEY)
        self.held: Any = None

    def take_refs(self, refs: list[RouteRef]) -> int:
        """Resolve this rank's refs; the bytes of the stored streams it read."""
        from r3store_client.tensors import compact

        mine = _rank_slice(refs, self.rank, self.world_size)
        spec, batch = self.client.resolve(mine)
        self.held = compact(batch, spec, "padded", executor=self.client.decoders)
        streams = [s.encoded for read in batch.found for s in read.segments if s.encoded]
        return sum(e.nbytes + (e.prefix.nbytes if e.prefix else 0) for e in streams)

    def take_verl(self, chunk: bytes) -> int:
        import torch

        self.held = torch.load(io.BytesIO(chunk), weights_only=True)["routed_experts"]
        return int(self.held.shape[0])

    def take_slime(self, data: list[npt.NDArray[np.int32]]) -> int:
        import torch

        mine = _rank_slice(data, self.rank, self.world_size)
        self.held = [torch.from_numpy(np.array(routes)) for routes in mine]
        return len(mine)

    def checksum(self) -> int:
        """The sum of the expert ids this rank holds (padding excluded); drops them."""
        import torch

        from r3store_client.tensors import CompactRoutes

        held, self.held = self.held, None
        if isinstance(held, CompactRoutes):  # full routes: every slot of a real token
            total = 0
            for b, length in enumerate(held.lengths.tolist()):
                if not bool((held.counts[b, :length] == held.ids.shape[-1]).all()):
                    raise AssertionError(f"sequence {b} lacks routes")
                total += int(held.ids[b, :length].sum(dtype=torch.int64))
            return total
        if isinstance(held, list):
            return sum(int(t.sum(dtype=torch.int64)) for t in held)
        return int(held.sum(dtype=torch.int64)) if isinstance(held, torch.Tensor) else -1


def _hand_refs(rollout: Any, trainers: list[Any], measure: bool) -> tuple[int, int, int]:
    """Refs: rollout -> driver -> every rank, which resolves its own slice. `measure`:
    count the bytes too (untimed runs: serializing to count takes time)."""
    refs = ray.get(rollout.get_refs.remote())
    fetched = sum(ray.get([t.take_refs.remote(refs) for t in trainers]))
    if not measure:
        return 0, 0, 0
    size = carried(refs)  # the rollout's answer, then each rank's call:
    return size * (1 + len(trainers)), size * len(trainers), fetched


def _hand_verl(rollout: Any, trainers: list[Any], measure: bool) -> tuple[int, int, int]:
    """verl: rollout -> driver (the whole batch) -> each rank its chunk."""
    import torch

    payload = ray.get(rollout.verl_batch.remote())
    put = carried(payload) if measure else 0
    batch = torch.load(io.BytesIO(payload), weights_only=True)["routed_experts"]
    del payload
    rows = list(range(batch.shape[0]))
    chunks = []
    for rank in range(len(trainers)):
        mine = _rank_slice(rows, rank, len(trainers))
        buffer = io.BytesIO()
        torch.save({"routed_experts": batch[mine[0] : mine[-1] + 1].contiguous()}, buffer)
        chunks.append(buffer.getvalue())
    del batch
    read = sum(carried(c) for c in chunks) if measure else 0
    calls = [t.take_verl.remote(c) for t, c in zip(trainers, chunks, strict=True)]
    del chunks  # in the object store now
    ray.get(calls)
    return put + read, read, 0


def _hand_slime(rollout: Any, trainers: list[Any], measure: bool) -> tuple[int, int, int]:
    """slime: rollout -> object store, the whole list -> every rank."""
    data = rollout.slime_data.remote()
    ray.get([t.take_slime.remote(data) for t in trainers])
    if not measure:
        return 0, 0, 0
    size = carried(ray.get(data))  # the driver reads it only to count it
    return size, size * len(trainers), 0


def run(quick: bool = False) -> tuple[list[Figure], dict[str, object]]:
    step = QUICK if quick else FULL
    repeats = 3 if quick else 5
    tmp = Path(tempfile.mkdtemp(prefix="r3store-ray-"))
    env = {"R3STORE_API_KEYS": json.dumps([{"name": "bench", "role": "admin", "key": KEY}])}
    process, url = start_server(tmp / "served", env)
    object_store = (512 << 20) if quick else (3 << 30)
    try:
        with local_cluster(object_store) as ray_start:
            rollout = Rollout.remote(step, url)  # type: ignore[attr-defined]
            trainers = [
                Trainer.remote(rank, step.ranks, url)  # type: ignore[attr-defined]
                for rank in range(step.ranks)
            ]
            token_layers = ray.get(rollout.token_layers.remote())
            write_seconds = ray.get(rollout.write.remote())
            ray.get([t.checksum.remote() for t in trainers])  # every actor up

            ways = {"refs": _hand_refs, "verl": _hand_verl, "slime": _hand_slime}
            times: dict[str, list[float]] = {way: [] for way in ways}
            bytes_put: dict[str, int] = {}
            bytes_read: dict[str, int] = {}
            sums: dict[str, list[list[int]]] = {}
            from_store = 0
            for repeat in range(repeats + 1):  # the first: a warm-up that counts bytes
                order = list(ways) if repeat % 2 else list(reversed(ways))
                for way in order:
                    ray.get(rollout.prepare.remote(way))
                    started = time.perf_counter()
                    put, read, fetched = ways[way](rollout, trainers, repeat == 0)
                    elapsed = time.perf_counter() - started
                    if repeat:
                        times[way].append(elapsed)
                    else:
                        bytes_put[way], bytes_read[way] = put, read
                        if way == "refs":
                            from_store = fetched
                    sums.setdefault(way, []).append(
                        ray.get([t.checksum.remote() for t in trainers])
                    )
                    ray.get(rollout.prepare.remote("none"))
            per_ref = carried(ray.get(rollout.get_refs.remote())[0])
    finally:
        stop_server(process)
    if len({tuple(each) for got in sums.values() for each in got}) != 1:
        raise AssertionError(f"the ranks were handed different routes: {sums}")
    median = {way: statistics.median(t) for way, t in times.items()}
    hand = f"hand to {step.ranks} ranks"
    figures = [
        Figure("ray: ray.init of a local cluster (2 CPUs)", ray_start, "s"),
        Figure(f"ray step: {step.size} samples, token-layers", token_layers / 1e6, "M"),
        Figure("ray step: the rollout writes it (AsyncRolloutWriter)", write_seconds, "s"),
        Figure("ray step: one route ref, as Ray serializes it", per_ref, "bytes", target="< 500"),
        Figure("ray step: refs, bytes into Ray", bytes_put["refs"] / 1e3, "kB"),
        Figure(
            "ray step: refs, stored bytes the ranks read from r3store",
            from_store / 1e3,
            "kB",
            bytes_read["verl"] / 1e3,
            "verl-style ranks' read",
        ),
    ]
    for way, what in (("verl", "verl-style int16 padded"), ("slime", "slime-style int32")):
        figures += [
            Figure(
                f"ray step: {what}, bytes into Ray",
                bytes_put[way] / 1e3,
                "kB",
                bytes_put["refs"] / 1e3,
                "refs",
            ),
            Figure(
                f"ray step: {way}-style, bytes the ranks read",
                bytes_read[way] / 1e3,
                "kB",
                bytes_read["refs"] / 1e3,
                "refs",
            ),
        ]
    figures.append(Figure(f"ray step: refs, {hand} (resolve)", median["refs"], "s"))
    for way in ("verl", "slime"):
        figures.append(
            Figure(f"ray step: {way}-style, {hand}", median[way], "s", median["refs"], "refs")
        )
    details: dict[str, object] = {
        "ray": {
            "step": asdict(step),
            "token_layers": token_layers,
            "ray_version": ray.__version__,
            "ray_init_seconds": round(ray_start, 2),
            "seconds": {way: [round(t, 3) for t in ts] for way, ts in times.items()},
            "bytes_put": bytes_put,
            "bytes_read": bytes_read,
            "bytes_per_ref": per_ref,
            "bytes_from_r3store": from_store,
        }
    }
    return figures, details
