"""The catalog's checks of consumption (`r3store.testing.catalog`): sampling counts,
leases, step checkpoints and resume, and what retention keeps of them, read and written
around the catalog through a database's backdoors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from r3store.errors import (
    Conflict,
    Fenced,
    LeaseClosed,
    LeaseCommitted,
    LeaseExpired,
    NotFound,
)
from r3store.leases import Checkpoint, Lease
from r3store.policy import NamespaceSettings, Retention
from r3store.storage.catalog import Catalog
from r3store.storage.catalog.leases import Candidate, Pick, Terms
from r3store.testing.catalog_base import SPEC, CatalogBackdoors, entry, shard

# leases of five seconds, of trajectories of any version not sampled yet
WINDOW = Terms(min_version=None, max_times=1, seconds=5.0)


def oldest(k: int) -> Pick:
    """The `k` trajectories stored first."""
    return lambda rows: [r[0] for r in sorted(rows, key=lambda r: r[2])[:k]]


def named(*wanted: str) -> Pick:
    """Those of `wanted` free to take."""
    return lambda rows: [r[0] for r in rows if r[0] in wanted]


class ConsumptionTests(CatalogBackdoors):
    """The consumption checks every catalog database passes."""

    def times(self, catalog: Catalog) -> dict[str, int]:
        """Each trajectory's sampling count, read around the catalog."""
        rows = self.raw_query(catalog, "SELECT trajectory_id, times_sampled FROM trajectories")
        return dict(rows)

    def test_sampling_counts_in_the_database(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        entries = [entry("a", "s1", version=1), entry("b", "s1", version=0)]
        self.commit(catalog, shard("s1", 2), entries)
        seen: list[list[str]] = []

        def every(rows: list[Candidate]) -> list[str]:
            seen.append(sorted(r[0] for r in rows))
            return [r[0] for r in rows]

        sample = Terms(min_version=None, max_times=1, seconds=60.0, commit=True)
        done = catalog.leases.take("ns", every, replace(sample, min_version=1), now=10.0)
        assert (seen, done.trajectory_ids, done.seq) == ([["a"]], ("a",), 1)
        catalog.leases.take("ns", every, sample, now=10.0)
        assert seen[-1] == ["b"]  # a was sampled its one time
        self.raw_execute(
            catalog, "UPDATE trajectories SET times_sampled = 5 WHERE trajectory_id = 'b'"
        )
        assert sorted(
            self.raw_query(catalog, "SELECT trajectory_id, times_sampled FROM trajectories")
        ) == [
            ("a", 1),
            ("b", 5),
        ]
        assert self.raw_query(catalog, "SELECT consumed FROM namespaces") == [(2,)]
        assert catalog.segments.sampling_totals("ns") == (6, 2)
        catalog.leases.take("ns", every, sample, now=10.0)
        assert seen[-1] == []
        assert catalog.segments.retention_victims("ns", 1, None, None) == ["b"]
        assert catalog.segments.retention_victims("ns", None, None, 5) == ["b"]
        assert catalog.segments.retention_victims("ns", None, 2.0, None) == ["a", "b"]

    def test_leases_hold_count_once_and_resume(self, catalog: Catalog) -> None:
        """One timeline of a namespace's consumption, step by step."""
        catalog.namespaces.create("ns", SPEC)
        ids = [f"t{i}" for i in range(4)]
        entries = [entry(t, "s1", created=float(i)) for i, t in enumerate(ids)]
        self.commit(catalog, shard("s1", 4), entries)
        self._leases_hold_and_count_once(catalog, ids)
        point, third = self._checkpoints_record_consumption(catalog)
        zombie = self._resume_undoes_and_fences(catalog, point)
        self._the_earlier_epoch_is_fenced(catalog, zombie, third)
        self._prune_and_trim_checkpoints(catalog)

    def _leases_hold_and_count_once(self, catalog: Catalog, ids: list[str]) -> None:
        """A lease holds its trajectories; a commit counts them once; an expired lease
        gives them back uncounted, and a commit refused for it marks it expired."""
        first = catalog.leases.take("ns", oldest(2), WINDOW, now=100.0)
        assert (first.trajectory_ids, first.epoch) == (("t0", "t1"), 0)
        second = catalog.leases.take("ns", oldest(2), WINDOW, now=101.0)
        assert second.trajectory_ids == ("t2", "t3")  # t0, t1 are held
        assert self.times(catalog) == dict.fromkeys(ids, 0)  # nothing counted before a commit
        assert self.raw_query(
            catalog, "SELECT state, expires_at FROM leases WHERE lease_id = ?", [first.lease_id]
        ) == [("open", 105.0)]
        committed = catalog.leases.commit("ns", first.lease_id, now=102.0)
        times = self.times(catalog)
        assert (committed.seq, times["t0"], times["t1"]) == (1, 1, 1)
        with pytest.raises(LeaseCommitted):
            catalog.leases.commit("ns", first.lease_id, now=102.5)
        with pytest.raises(LeaseExpired):  # second expired at 106: t2, t3 went back
            catalog.leases.commit("ns", second.lease_id, now=106.0)
        assert self.times(catalog)["t2"] == 0
        assert self.raw_query(  # the refused commit marked it expired, once and for all
            catalog, "SELECT state, closed_at FROM leases WHERE lease_id = ?", [second.lease_id]
        ) == [("expired", 106.0)]
        assert catalog.leases.open("ns", 105.9) == []

    def _checkpoints_record_consumption(self, catalog: Catalog) -> tuple[Checkpoint, Lease]:
        """A checkpoint records the consumption so far (the same step again is the same
        checkpoint, unless consumption moved on); returns it and a lease committed after
        it, whose trajectories retention must keep."""
        point = catalog.checkpoints.checkpoint("ns", 1, now=107.0)
        assert (point.step, point.consumed, point.epoch) == (1, 1, 0)
        assert catalog.checkpoints.checkpoint("ns", 1, now=107.5) == point  # a repeat
        third = catalog.leases.take("ns", oldest(2), WINDOW, now=108.0)
        assert third.trajectory_ids == ("t2", "t3")
        catalog.leases.commit("ns", third.lease_id, now=109.0)
        assert catalog.leases.protected("ns", now=109.0) == {"t2", "t3"}
        with pytest.raises(Conflict):  # step 1 again, with other consumption
            catalog.checkpoints.checkpoint("ns", 1, now=109.5)
        return point, third

    def _resume_undoes_and_fences(self, catalog: Catalog, point: Checkpoint) -> Lease:
        """A resume to `point` undoes what was committed after it, fences the open
        lease, drops the later checkpoint and moves the epoch on; returns the fenced
        lease."""
        catalog.checkpoints.checkpoint("ns", 2, now=110.0)
        zombie = catalog.leases.take("ns", oldest(1), replace(WINDOW, seconds=50.0), now=110.0)
        assert zombie.trajectory_ids == ()  # every trajectory was sampled its one time
        done = catalog.checkpoints.resume("ns", 1, now=111.0)
        assert (done.epoch, done.leases_undone, done.samplings_undone) == (1, 1, 2)
        assert (done.leases_fenced, done.checkpoints_dropped) == (1, [2])
        assert self.times(catalog) == {"t0": 1, "t1": 1, "t2": 0, "t3": 0}
        assert self.raw_query(catalog, "SELECT epoch, consumed FROM namespaces") == [(1, 1)]
        assert catalog.checkpoints.checkpoint("ns", 1, now=111.5) == point  # nothing since
        return zombie

    def _the_earlier_epoch_is_fenced(self, catalog: Catalog, zombie: Lease, third: Lease) -> None:
        """After the resume, the earlier run's leases and takes are refused; the resumed
        run takes again what the checkpoint implies, and a released lease stays closed."""
        with pytest.raises(Fenced):
            catalog.leases.commit("ns", zombie.lease_id, now=112.0)
        with pytest.raises(Fenced):
            catalog.leases.commit("ns", third.lease_id, now=112.0)  # undone by the resume
        with pytest.raises(Fenced):
            catalog.leases.take("ns", oldest(1), replace(WINDOW, epoch=0), now=112.0)
        again = catalog.leases.take("ns", oldest(2), replace(WINDOW, epoch=1), now=112.0)
        assert again.trajectory_ids == ("t2", "t3")  # what the checkpoint implies
        released = catalog.leases.release("ns", again.lease_id, now=113.0)
        assert released.state == "released"
        with pytest.raises(LeaseClosed):
            catalog.leases.renew("ns", again.lease_id, 5.0, now=113.5)

    def _prune_and_trim_checkpoints(self, catalog: Catalog) -> None:
        """Pruning forgets closed leases and keeps the newest `keep_checkpoints`
        checkpoints; a deleted checkpoint is gone, and so is a resume to it."""
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [1]
        assert catalog.leases.prune("ns", before=1000.0) >= 3
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [1]
        for step in (2, 3):
            catalog.checkpoints.checkpoint("ns", step, now=113.6)
        catalog.namespaces.update_settings(
            "ns", NamespaceSettings(retention=Retention(keep_checkpoints=1))
        )
        catalog.leases.prune("ns", before=0.0)  # keep_checkpoints lowered to 1: trimmed
        assert [c.step for c in catalog.checkpoints.checkpoints("ns")] == [3]
        catalog.checkpoints.delete_checkpoint("ns", 3)
        with pytest.raises(NotFound):
            catalog.checkpoints.delete_checkpoint("ns", 3)
        with pytest.raises(NotFound):
            catalog.checkpoints.resume("ns", 1, now=114.0)

    def test_retention_keeps_what_leases_and_checkpoints_hand_out(self, catalog: Catalog) -> None:
        catalog.namespaces.create("ns", SPEC)
        ids = ["a", "b", "c", "d"]
        entries = [entry(t, "s1", created=float(i)) for i, t in enumerate(ids)]
        self.commit(catalog, shard("s1", 4), entries)
        terms = Terms(min_version=None, max_times=None, seconds=50.0)
        catalog.checkpoints.checkpoint("ns", 0, now=1.0)
        done = catalog.leases.take("ns", named("a"), terms, now=2.0)
        catalog.leases.commit("ns", done.lease_id, now=3.0)
        # retention chose its victims before this lease was taken: the lease keeps b
        catalog.leases.take("ns", named("b"), terms, now=4.0)
        assert catalog.leases.drop("ns", ids, ["s1"], now=5.0) == (2, 2)  # c, d dropped
        assert sorted(catalog.segments.lookup("ns", ids)) == ["a", "b"]
        catalog.checkpoints.resume("ns", 0, now=6.0)  # a undone, b's lease fenced
        # a is handed out again by the resumed run: still kept while checkpoint 0 is
        assert catalog.leases.protected("ns", now=7.0) == {"a"}
        assert catalog.leases.drop("ns", ["a", "b"], ["s1"], now=7.0) == (1, 1)
        assert catalog.leases.prune("ns", before=10**6) == 1  # b's fenced lease, not a's
        catalog.checkpoints.delete_checkpoint("ns", 0)
        assert catalog.leases.protected("ns", now=8.0) == set()
