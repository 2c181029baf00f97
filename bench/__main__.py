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
    request_bench,
    rest_bench,
    venvs,
)
from bench.figures import Figure, print_table, write_json
from r3store.testing import seaweedfs

RESULTS = Path(__file__).parent / "results" / "latest.json"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--only",
        default="codec,rest,engine,http,datapath,requests,direct,catalog,memory,hardening,abuse"
        ",leases,replay,ray,async,grpo,transferqueue",
    )
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    sections = set(args.only.split(","))
    started = time.perf_counter()
    figures: list[Figure] = []
    details: dict[str, object] = {}

    def chosen(section: str, what: str) -> bool:
        """Whether `section` is to run; if so, say that it starts."""
        if section in sections:
            print(f"{what} ...", flush=True)
        return section in sections

    def add(result: tuple[list[Figure], dict[str, object]]) -> None:
        """A section's figures and the details it found."""
        more, detail = result
        figures.extend(more)
        details.update(detail)

    if chosen("codec", "codec"):
        figures += codec_bench.run(tokens=1024 if args.quick else 4096)
    if chosen("rest", "rest (trained-model corpus: made once, cached in bench/.corpus)"):
        figures += rest_bench.run(quick=args.quick)
    if chosen("engine", "engine (starting SeaweedFS)"):
        with seaweedfs.running() as server:
            figures += engine_bench.run(server, count=32 if args.quick else 256)
    if chosen("http", "http"):
        figures += http_bench.run(count=32 if args.quick else 256)
    if chosen("datapath", "datapath (starting SeaweedFS)"):
        with seaweedfs.running() as server:
            figures += datapath_bench.run(server, count=32 if args.quick else 256)
    if chosen("requests", "requests (a request's server CPU, starting SeaweedFS)"):
        with seaweedfs.running() as server:
            figures += request_bench.run(server, requests=100 if args.quick else 400)
    if chosen("direct", "direct (fuzzing direct commits, starting SeaweedFS)"):
        with seaweedfs.running() as server:
            more, detail = direct_fuzz_bench.run(server, cases=300 if args.quick else 2000)
        figures += more
        details["direct_fuzz"] = detail
    if chosen("catalog", "catalog"):
        figures += catalog_bench.run(count=32 if args.quick else 128)
    if chosen("memory", "memory"):
        figures += memory_bench.run((1 << 28) if args.quick else (4 << 30))
    if chosen("hardening", "hardening (fuzzing uploads, then upload memory)"):
        add(hardening_bench.run(quick=args.quick))
    if chosen("abuse", "abuse (a fresh server per attack, a bystander asking /healthz)"):
        add(abuse_bench.run(quick=args.quick))
    if chosen("leases", "leases (a trainer and its server SIGKILLed, resumed from checkpoints)"):
        add(lease_bench.run(quick=args.quick))
    if chosen("replay", "replay (the token check beside none, on the tests' models)"):
        figures += replay_bench.run(quick=args.quick)
    if chosen("ray", "ray (route refs beside routes by value, in a local Ray cluster)"):
        from bench import ray_bench  # ray: a dev dependency, loaded only here

        add(ray_bench.run(quick=args.quick))
    if chosen("async", "async (asyncio ingest beside threaded ingest, one server)"):
        figures += async_bench.run(quick=args.quick)
    if chosen("grpo", "grpo (a GRPO loop through the service, with and without R3)"):
        add(grpo_bench.run(quick=args.quick))
    if chosen(
        "transferqueue", "transferqueue (SimpleStorage beside r3store's backend, verl's env)"
    ):
        add(venvs.run("bench.tq_bench", "verl", quick=args.quick))
    print()
    print_table(figures)
    write_json(figures, args.out, time.perf_counter() - started, details)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
