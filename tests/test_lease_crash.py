"""SIGKILL a trainer (and in some rounds the server under it) at random moments of its
leases, commits and checkpoints: after resuming from its last acknowledged checkpoint,
its timeline is the uninterrupted run's, nothing is lost or counted twice, evicted
routes a kept checkpoint may hand out again stay readable, and zombies are fenced
(`lease_campaign`). The server stores on the real S3 server of the tests (SeaweedFS)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lease_campaign import Campaign
from r3store.testing.seaweedfs import SeaweedFS


@pytest.mark.slow
def test_a_crashing_trainer_resumes_the_uninterrupted_timeline(
    tmp_path: Path, seaweed: SeaweedFS
) -> None:
    tally = Campaign(tmp_path, rounds=20, seed=7, seaweed=seaweed).run()
    summary = tally.summary()
    print(summary)
    assert not tally.failures(), (tally.failures(), summary)
    assert tally.rounds >= 20
    assert tally.trainer_kills >= 15, summary
    assert tally.server_kills >= 3, summary
    assert tally.kills_between_lease_and_commit >= 3, summary
    assert tally.zombie_commits_refused >= 3, summary
    assert tally.zombie_leases_fenced >= 2, summary
    assert tally.evicted > 0, summary
    assert tally.readable_after_oldest_checkpoint > 0, summary
