"""Engine ingest and batch-read throughput on the local store and on SeaweedFS, beside a
naive baseline: one `.npy` object of uint8 ids per trajectory, boto3, 8 threads."""

from __future__ import annotations

import io
import tempfile
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from bench.figures import Figure, median_of, timed
from r3store.engine import Engine, EngineConfig
from r3store.engine.reader import ReaderConfig
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.catalog import Catalog
from r3store.storage.store import LocalStore, ObjectStore, S3Store
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import uniform_topk

LAYERS, EXPERTS, K = 48, 128, 8
SPEC = RouteSpec(LAYERS, EXPERTS, K)
THREADS = 8
READ_BATCH = 32


class Workload:
    """`count` trajectories of `tokens` tokens; `pool` distinct route arrays cycled."""

    def __init__(self, count: int, tokens: int, pool: int = 32) -> None:
        rng = np.random.default_rng(1)
        self.tokens = tokens
        self.arrays = [
            uniform_topk(rng, tokens - 1, LAYERS, EXPERTS, K, dtype=np.uint8) for _ in range(pool)
        ]
        self.ids = [f"traj-{i:05d}" for i in range(count)]

    def routes(self, i: int) -> np.ndarray:
        return self.arrays[i % len(self.arrays)]

    @property
    def token_layers(self) -> int:
        return len(self.ids) * self.tokens * LAYERS


def naive(client: object, bucket: str, work: Workload) -> tuple[float, float, int]:
    """(ingest seconds, read seconds, bytes) of one object per trajectory."""
    prefix = f"naive-{uuid.uuid4().hex[:8]}/"

    def put(i: int) -> int:
        buf = io.BytesIO()
        np.save(buf, work.routes(i))
        body = buf.getvalue()
        client.put_object(Bucket=bucket, Key=prefix + work.ids[i], Body=body)  # type: ignore[attr-defined]
        return len(body)

    def get(i: int) -> np.ndarray:
        body = client.get_object(Bucket=bucket, Key=prefix + work.ids[i])["Body"].read()  # type: ignore[attr-defined]
        return np.load(io.BytesIO(body))

    with ThreadPoolExecutor(THREADS) as pool:
        sizes: list[int] = []
        ingest = timed(lambda: sizes.extend(pool.map(put, range(len(work.ids)))))
        read = median_of(3, lambda: timed(lambda: list(pool.map(get, range(len(work.ids))))))
    return ingest, read, sum(sizes)


def ours(store_factory: Callable[[], ObjectStore], work: Workload, tmp: Path) -> dict[str, float]:
    """Ingest with 8 writer threads, then batch reads of 32 ids: cold and just written."""
    db = tmp / f"catalog-{uuid.uuid4().hex[:8]}.db"
    store: ObjectStore = store_factory()
    engine = Engine(store, Catalog(f"sqlite:///{db}"))
    engine.namespaces.create("bench", SPEC)

    def put(i: int) -> None:
        engine.put("bench", [TrajectoryWrite(work.ids[i], work.tokens, topk=work.routes(i))])

    with ThreadPoolExecutor(THREADS) as pool:
        ingest = timed(lambda: list(pool.map(put, range(len(work.ids)))))
    batches = [work.ids[i : i + READ_BATCH] for i in range(0, len(work.ids), READ_BATCH)]

    def read_all(eng: Engine, decode: bool = True) -> None:
        for batch in batches:
            result = eng.get_batch("bench", batch, decode=decode)
            assert not result.missing

    warm = median_of(3, lambda: timed(lambda: read_all(engine)))
    stored = sum(info.size for info in store.list("shards/"))
    engine.close()
    cold_config = EngineConfig(reader=ReaderConfig(cache_bytes=0))

    def cold_read(decode: bool) -> float:
        eng = Engine(store_factory(), Catalog(f"sqlite:///{db}"), cold_config)
        try:
            return timed(lambda: read_all(eng, decode))
        finally:
            eng.close()

    cold = median_of(3, lambda: cold_read(True))
    raw = median_of(3, lambda: cold_read(False))
    return {"ingest": ingest, "warm": warm, "cold": cold, "raw": raw, "bytes": stored}


def run(seaweed: SeaweedFS, count: int = 256, tokens: int = 4096) -> list[Figure]:
    work = Workload(count, tokens)
    n = work.token_layers
    tmp = Path(tempfile.mkdtemp(prefix="r3store-bench-"))
    s3_probe = seaweed.new_store()
    client = s3_probe._client
    naive_ingest, naive_read, naive_bytes = naive(client, s3_probe.bucket, work)
    naive_in_rate = n / naive_ingest / 1e6
    naive_read_rate = n / naive_read / 1e6
    figures = [
        Figure("naive .npy/boto3 x8 on SeaweedFS: ingest", naive_in_rate, "M token-layers/s"),
        Figure("naive .npy/boto3 x8 on SeaweedFS: read", naive_read_rate, "M token-layers/s"),
    ]
    prefix = f"bench-{uuid.uuid4().hex[:8]}"
    backends = {
        "local store": lambda: LocalStore(tmp / "objects"),
        "SeaweedFS": lambda: S3Store(seaweed.config(prefix)),
    }
    for label, factory in backends.items():
        result = ours(factory, work, tmp)
        figures += [
            Figure(
                f"engine on {label}: ingest (durable, cataloged)",
                n / result["ingest"] / 1e6,
                "M token-layers/s",
                naive_in_rate,
                "naive ingest",
                ">= 1.0x",
            ),
            Figure(
                f"engine on {label}: batch read, cold (decoded)",
                n / result["cold"] / 1e6,
                "M token-layers/s",
                naive_read_rate,
                "naive read",
                ">= 1.0x",
            ),
            Figure(
                f"engine on {label}: batch read, just written (decoded)",
                n / result["warm"] / 1e6,
                "M token-layers/s",
                naive_read_rate,
                "naive read",
            ),
            Figure(
                f"engine on {label}: batch read, cold (stored streams)",
                n / result["raw"] / 1e6,
                "M token-layers/s",
                naive_read_rate,
                "naive read",
            ),
            Figure(
                f"engine on {label}: stored bytes",
                result["bytes"] / 2**20,
                "MiB",
                naive_bytes / 2**20,
                "naive .npy bytes",
                "<= 0.70x",
            ),
        ]
    return figures
