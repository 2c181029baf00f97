"""Fuzzing direct writes against a real server on SeaweedFS (`r3store.testing.direct_fuzz`):
forged and foreign plans, other writers' plans, blobs never uploaded or cut short,
spans and sizes that lie, streams that are not what they say, bad metadata, and valid
controls. No bad commit is acknowledged (or left where a rebuild would find it), none
is answered 5xx, the server never dies, and every control reads back as written.

`make bench` runs the same campaign for more cases and records the counts.
"""

from __future__ import annotations

from r3store.testing.direct_fuzz import run
from r3store.testing.direct_mutations import CASES
from r3store.testing.seaweedfs import SeaweedFS


def test_direct_commit_fuzz(seaweed: SeaweedFS) -> None:
    report = run(seaweed, cases=150, seed=7)
    detail = report.summary()
    assert report.cases == 150, detail
    assert set(report.by_kind) >= set(CASES), detail  # every kind at least once
    assert report.bad_acks == 0, detail
    assert report.server_errors == 0, detail
    assert report.deaths == 0, detail
    assert report.setup_failures == 0, detail
    assert report.controls > 0, detail
    assert report.all_controls_ok, detail
    assert report.rejected > 0, detail
