"""TransferQueue with its own SimpleStorage beside TransferQueue with r3store's backend
(`r3store_client.transferqueue`), side by side in one run: a GRPO step of realistic
shape put one trajectory at a time by concurrent agent loops, read by the trainer,
cleared. Runs in verl's environment (`.venv-verl`, where TransferQueue and Ray are):
`python -m bench` starts it there; alone, `.venv-verl/bin/python -m bench.tq_bench`.

Figures per step (medians of the steps): put time, get time, the bytes TransferQueue's
storage units hold (counted in the units), their peak RSS, and the route bytes the
trainer's read moves (SimpleStorage: the tensors; r3store: what its server sends).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from bench.figures import Figure

LAYERS, EXPERTS, TOP_K = 48, 128, 8
WRITERS = 8  # agent loops putting at once


def grpo_step(rng: np.random.Generator, samples: int, prompt: int, longest: int) -> list[Any]:
    """One step's samples: verl's fields of each trajectory (routes int16 over prompt
    and response, distinct experts per token-layer)."""
    import torch

    out = []
    for _ in range(samples):
        response = int(rng.integers(longest // 28, longest + 1))
        tokens = prompt + response
        base = rng.integers(0, EXPERTS, (tokens, LAYERS, 1))
        offsets = np.stack([rng.permutation(EXPERTS)[:TOP_K] for _ in range(LAYERS)])
        routes = (base + offsets[None]) % EXPERTS
        out.append(
            {
                "routed_experts": torch.from_numpy(routes.astype(np.int16))[None],
                "input_ids": torch.from_numpy(rng.integers(0, 150_000, tokens))[None],
                "response_mask": torch.ones(1, response, dtype=torch.int64),
                "prompt_len": prompt,
            }
        )
    return out


def _held(handles: list[Any]) -> tuple[dict[str, int], int]:
    """Bytes of tensors the storage units hold, by field, and the sum of their
    processes' peak RSS."""
    import ray

    def measure(unit: Any) -> tuple[dict[str, int], int]:
        import resource

        held = {
            field: sum(v.numel() * v.element_size() for v in rows.values() if hasattr(v, "numel"))
            for field, rows in unit.storage_data.field_data.items()
        }
        return held, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

    found = ray.get([h.__ray_call__.remote(measure) for h in handles])
    total: dict[str, int] = {}
    for fields, _peak in found:
        for field, n in fields.items():
            total[field] = total.get(field, 0) + n
    return total, sum(f[1] for f in found)


def _bytes_out(url: str) -> float:
    import httpx

    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith("r3store_bytes_out_total "):
            return float(line.split()[1])
    return 0.0


async def _put_step(keys: list[str], step: list[Any], version: int) -> None:
    """One put per trajectory, `WRITERS` at once, as agent loops put them."""
    import transfer_queue as tq
    from tensordict import TensorDict

    gate = asyncio.Semaphore(WRITERS)

    async def put(key: str, sample: dict[str, Any]) -> None:
        fields = TensorDict({k: v for k, v in sample.items() if k != "prompt_len"}, [1])
        tag = {"prompt_len": sample["prompt_len"], "global_steps": version}
        async with gate:
            await tq.async_kv_batch_put(keys=[key], partition_id="train", fields=fields, tags=[tag])

    await asyncio.gather(*(put(k, s) for k, s in zip(keys, step, strict=True)))


def run_mode(backend: str, url: str, namespace: str, steps: list[list[Any]]) -> dict[str, float]:
    """Each step through TransferQueue with `backend`; the medians."""
    import torch
    import transfer_queue as tq
    import transfer_queue.interface as tq_interface

    spec = {"num_layers": LAYERS, "num_experts": EXPERTS, "top_k": TOP_K}
    tq.init(
        {
            "backend": {
                "storage_backend": backend,
                "SimpleStorage": {"num_data_storage_units": 2},
                "R3Store": {"url": url, "namespace": namespace, "spec": spec},
            }
        }
    )
    units = list(tq_interface._TQ_STORAGE["SimpleStorage"].values())
    puts, gets, held, moved = [], [], [], []
    try:
        for n, step in enumerate(steps):
            keys = [f"s{n}_{i}" for i in range(len(step))]

            started = time.perf_counter()
            asyncio.run(_put_step(keys, step, n))
            puts.append(time.perf_counter() - started)
            fields = _held(units)[0]
            held.append((fields.get("routed_experts", 0), sum(fields.values())))
            before = _bytes_out(url)
            started = time.perf_counter()
            got = tq.kv_batch_get(keys=keys, partition_id="train")
            gets.append(time.perf_counter() - started)
            routes = got["routed_experts"]
            moved.append(
                _bytes_out(url) - before
                if backend == "R3Store"
                else float(routes.values().numel() * routes.values().element_size())
            )
            for part, sample in zip(routes.unbind(), step, strict=True):
                if not torch.equal(part, sample["routed_experts"][0]):
                    raise AssertionError(f"{backend}: a sample read back other routes")
            tq.kv_clear(keys=keys, partition_id="train")
        peak = _held(units)[1]
    finally:
        tq.close()
    return {
        "put_seconds": statistics.median(puts),
        "get_seconds": statistics.median(gets),
        "held_route_bytes": statistics.median(h[0] for h in held),
        "held_bytes": statistics.median(h[1] for h in held),
        "peak_rss": float(peak),
        "read_bytes": statistics.median(moved),
    }


def run(quick: bool = False) -> tuple[list[Figure], dict[str, object]]:
    import ray

    import r3store_client.transferqueue  # noqa: F401 (registers the backend)
    from r3store.testing.service import start_server, stop_server

    samples, prompt, longest = (16, 256, 1024) if quick else (64, 1024, 7168)
    rng = np.random.default_rng(0)
    steps = [grpo_step(rng, samples, prompt, longest) for _ in range(3)]
    route_bytes = statistics.median(
        sum(s["routed_experts"].numel() * 2 for s in step) for step in steps
    )
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        process, url = start_server(Path(tmp))
        try:
            simple = run_mode("SimpleStorage", url, "tq", steps)
            mine = run_mode("R3Store", url, "tq", steps)
        finally:
            stop_server(process)
            ray.shutdown()
    shape = f"{samples} samples, {prompt}+{longest // 28}-{longest} tokens"
    figures = [
        Figure(
            f"TQ storage units' route bytes, r3store backend ({shape})",
            mine["held_route_bytes"],
            "bytes/step",
            simple["held_route_bytes"],
            "SimpleStorage",
            "<= 0.01x",
        ),
        Figure(
            "TQ storage units' bytes, every field, r3store backend",
            mine["held_bytes"],
            "bytes/step",
            simple["held_bytes"],
            "SimpleStorage",
        ),
        Figure(
            "TQ put+get per step, r3store backend (durable)",
            mine["put_seconds"] + mine["get_seconds"],
            "s",
            simple["put_seconds"] + simple["get_seconds"],
            "SimpleStorage (RAM)",
            "<= 1.5x",
        ),
        Figure(
            "TQ put per step, r3store backend",
            mine["put_seconds"],
            "s",
            simple["put_seconds"],
            "SimpleStorage",
        ),
        Figure(
            "TQ get per step, r3store backend",
            mine["get_seconds"],
            "s",
            simple["get_seconds"],
            "SimpleStorage",
        ),
        Figure(
            "TQ storage units' peak RSS, r3store backend",
            mine["peak_rss"],
            "bytes",
            simple["peak_rss"],
            "SimpleStorage",
        ),
        Figure(
            "TQ bytes the trainer's read moves, r3store backend",
            mine["read_bytes"],
            "bytes/step",
            simple["read_bytes"],
            "SimpleStorage",
        ),
    ]
    detail = {"route_bytes_per_step": route_bytes, "simple": simple, "r3store": mine}
    return figures, {"transferqueue": detail}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    os.environ.setdefault("TQ_NUM_THREADS", "2")
    figures, detail = run(quick=args.quick)
    for f in figures:
        print(
            f"{f.name:<62} {f.value:12.4g} {f.unit:<10} {f.baseline or 0:12.4g} {f.ratio or 0:7.3f}"
        )
    if args.json is not None:
        args.json.write_text(json.dumps({"figures": [asdict(f) for f in figures], **detail}))


if __name__ == "__main__":
    main()
