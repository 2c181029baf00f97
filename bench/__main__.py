"""Run the benchmarks: `python -m bench [--quick] [--only codec,rest,...,direct,ray,grpo]`."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bench import (
    abuse_bench,
    async_bench,
    catalog_bench,
    codec_bench,
    datapath_bench,
    direct_fuzz_bench,
    engine_bench,
    grpo_bench,
    hardening_bench,
    http_bench,
    lease_bench,
    memory_bench,
    replay_bench,
    rest_bench,
    verl_env,
)
from bench.figures import Figure, print_table, write_json
from r3store.testing import seaweedfs

RESULTS = Path(__file__).parent / "results" / "latest.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--only",
        default="codec,rest,engine,http,datapath,direct,catalog,memory,hardening,abuse,leases,replay"
        ",ray,async,grpo,transferqueue",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sections = set(args.only.split(","))
    started = time.perf_counter()
    figures: list[Figure] = []
    details: dict[str, object] = {}
    if "codec" in sections:
        print("codec ...", flush=True)
        figures += codec_bench.run(tokens=1024 if args.quick else 4096)
    if "rest" in sections:
        print("rest (trained-model corpus: made once, cached in bench/.corpus) ...", flush=True)
        figures += rest_bench.run(quick=args.quick)
    if "engine" in sections:
        print("engine (starting SeaweedFS) ...", flush=True)
        with seaweedfs.running() as server:
            figures += engine_bench.run(server, count=32 if args.quick else 256)
    if "http" in sections:
        print("http ...", flush=True)
        figures += http_bench.run(count=32 if args.quick else 256)
    if "datapath" in sections:
        print("datapath (starting SeaweedFS) ...", flush=True)
        with seaweedfs.running() as server:
            figures += datapath_bench.run(server, count=32 if args.quick else 256)
    if "direct" in sections:
        print("direct (fuzzing direct commits, starting SeaweedFS) ...", flush=True)
        with seaweedfs.running() as server:
            more, detail = direct_fuzz_bench.run(server, cases=300 if args.quick else 2000)
        figures += more
        details["direct_fuzz"] = detail
    if "catalog" in sections:
        print("catalog ...", flush=True)
        figures += catalog_bench.run(count=32 if args.quick else 128)
    if "memory" in sections:
        print("memory ...", flush=True)
        figures += memory_bench.run((1 << 28) if args.quick else (4 << 30))
    if "hardening" in sections:
        print("hardening (fuzzing uploads, then upload memory) ...", flush=True)
        more, detail = hardening_bench.run(quick=args.quick)
        figures += more
        details.update(detail)
    if "abuse" in sections:
        print("abuse (a fresh server per attack, a bystander asking /healthz) ...", flush=True)
        more, detail = abuse_bench.run(quick=args.quick)
        figures += more
        details.update(detail)
    if "leases" in sections:
        print(
            "leases (a trainer and its server SIGKILLed, resumed from checkpoints) ...", flush=True
        )
        more, detail = lease_bench.run(quick=args.quick)
        figures += more
        details.update(detail)
    if "replay" in sections:
        print("replay (the token check beside none, on the tests' models) ...", flush=True)
        figures += replay_bench.run(quick=args.quick)
    if "ray" in sections:
        print("ray (route refs beside routes by value, in a local Ray cluster) ...", flush=True)
        from bench import ray_bench  # ray: a dev dependency, loaded only here

        more, detail = ray_bench.run(quick=args.quick)
        figures += more
        details.update(detail)
    if "async" in sections:
        print("async (asyncio ingest beside threaded ingest, one server) ...", flush=True)
        figures += async_bench.run(quick=args.quick)
    if "grpo" in sections:
        print("grpo (a GRPO loop through the service, with and without R3) ...", flush=True)
        more, detail = grpo_bench.run(quick=args.quick)
        figures += more
        details.update(detail)
    if "transferqueue" in sections:
        print("transferqueue (SimpleStorage beside r3store's backend, verl's env) ...", flush=True)
        more, detail = verl_env.run("bench.tq_bench", quick=args.quick)
        figures += more
        details.update(detail)
    print()
    print_table(figures)
    write_json(figures, args.out, time.perf_counter() - started, details)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
