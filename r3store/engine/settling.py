"""Settling rows against what is stored: each segment of a put decided against the
segments the catalog holds of its trajectory and source (and the put's earlier rows)
by `r3store.records.settle`: new, a retry of stored content, a conflict or a bad
append. Pure: the caller looks the stored segments up (`known_segments` of a
catalog lookup). The encoder refuses early what the commit would; the committers
settle again, against the catalog as it is when they commit.
"""

from __future__ import annotations

from collections import defaultdict

from r3store.catalog_types import TrajectoryEntry
from r3store.policy import ENGINE, Source
from r3store.records import Held, PutResult, Segment, settle
from r3store.storage.shard import ShardRow


def as_segment(row: ShardRow | TrajectoryEntry) -> Segment:
    return Segment(
        row.start,
        row.num_tokens,
        row.digest,
        row.group_id,
        row.prompt_len,
        row.policy_version,
        row.writer,
    )


RowKey = tuple[str, Source, int]  # trajectory id, source, start
Known = dict[tuple[str, Source], list[Segment]]  # stored segments per id and source


def row_key(row: ShardRow) -> RowKey:
    return (row.trajectory_id, row.source, row.start)


def known_segments(found: dict[str, list[TrajectoryEntry]]) -> Known:
    """What a catalog lookup found, as segments per trajectory and source."""
    known: Known = defaultdict(list)
    for segments in found.values():
        for e in segments:
            known[(e.trajectory_id, e.source)].append(as_segment(e))
    return dict(known)


def settle_rows(
    rows: list[ShardRow], known: Known
) -> tuple[list[ShardRow], dict[RowKey, PutResult]]:
    """Settle rows (in start order) against the segments `known` per trajectory and
    source.

    Returns the rows to store and a result per `(id, source, start)`; raises on the
    first conflict or bad append. `known` is not changed.
    """
    fresh: list[ShardRow] = []
    results: dict[RowKey, PutResult] = {}
    held: dict[tuple[str, Source], Held] = {}
    for row in sorted(rows, key=lambda r: r.start):
        unit = (row.trajectory_id, row.source)
        where = row.trajectory_id
        if row.source != ENGINE:
            where = f"{where} ({row.source} routes)"
        segments = held.get(unit)
        if segments is None:
            segments = held[unit] = Held(known.get(unit, []))
        created = settle(where, row.start, row.digest, segments)
        if created:
            segments.add(as_segment(row))
            fresh.append(row)
        results[row_key(row)] = result_of(row, created)
    return fresh, results


def result_of(row: ShardRow, created: bool) -> PutResult:
    """What a put answers for `row` (stored now, or `created` False: stored before)."""
    return PutResult(
        row.trajectory_id,
        created,
        row.start,
        row.source,
        row.num_tokens,
        row.policy_version,
        row.digest,
    )
