"""Leases, checkpoints and resume under crashes: the campaign of
`tests/test_lease_crash.py` (`tests/lease_campaign.py`) for more rounds. A trainer
process is SIGKILLed at random events of its leases, commits and checkpoints (the server
too, every fourth round, restarted on the same data), resumes from its last
acknowledged checkpoint, and must train on exactly the uninterrupted run's FIFO
batches, each trajectory counted once, evicted routes a kept checkpoint may hand out
again still readable, and every zombie commit or call of an earlier epoch refused
(goal: 0 lost, 0 double counted, 0 mismatched, 0 zombies accepted)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from bench.figures import Figure

TESTS = Path(__file__).resolve().parent.parent / "tests"


def run(quick: bool = False, seed: int = 1) -> tuple[list[Figure], dict[str, object]]:
    sys.path.insert(0, str(TESTS))  # the campaign and its trainer live beside the test
    from lease_campaign import Campaign

    rounds = 10 if quick else 100
    with tempfile.TemporaryDirectory(prefix="r3store-leases-") as directory:
        tally = Campaign(Path(directory), rounds, seed=seed, server_kill_every=4).run()
    summary = tally.summary()
    for failure in tally.failures():
        print(f"  FAILED: {failure}", flush=True)
    figures = [
        Figure("leases: crash rounds (trainer SIGKILLed)", tally.rounds, "rounds"),
        Figure("leases: server SIGKILLs under the trainer", tally.server_kills, "kills"),
        Figure("leases: batches trained and checked", tally.batches_checked, "batches"),
        Figure("leases: batches lost", tally.lost, "batches", target="0"),
        Figure(
            "leases: trajectories counted twice", tally.double_counted, "trajectories", target="0"
        ),
        Figure(
            "leases: batches not the uninterrupted run's", tally.mismatched, "batches", target="0"
        ),
        Figure("leases: zombie commits refused (Fenced)", tally.zombie_commits_refused, "commits"),
        Figure(
            "leases: zombie commits accepted", tally.zombie_commits_accepted, "commits", target="0"
        ),
        Figure(
            "leases: leases and checkpoints of an old epoch refused",
            tally.zombie_epoch_calls_refused,
            "calls",
        ),
    ]
    if summary["resume_median_s"] is not None:
        figures.append(Figure("leases: resume median", summary["resume_median_s"] * 1000, "ms"))
    if summary["server_restart_median_s"] is not None:
        figures.append(
            Figure(
                "leases: server restart to ready, median", summary["server_restart_median_s"], "s"
            )
        )
    return figures, {"leases": summary}
