"""Tombstones (`tombstones/<namespace>/<time>.json`, docs/format.md): the segments
retention dropped, stored before the catalog forgets them so a catalog rebuild leaves
them out of the shards that still hold them. One JSON object: `namespace`, `segments`
(`[trajectory id, start, digest hex]` each) and `shards` (the keys that held them)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

from r3store.catalog_types import TrajectoryEntry
from r3store.errors import ObjectNotFound
from r3store.storage.keys import TOMBSTONE_PREFIX
from r3store.storage.store.base import ObjectStore

Dropped = tuple[str, str, int, bytes]  # namespace, trajectory id, start, digest


@dataclass(frozen=True)
class Tombstone:
    namespace: str
    segments: list[tuple[str, int, bytes]]  # trajectory id, start, digest
    shards: list[str]


def tombstone(namespace: str, entries: Sequence[TrajectoryEntry]) -> bytes:
    """The tombstone of the catalog entries `entries` of `namespace`."""
    return json.dumps(
        {
            "namespace": namespace,
            "segments": [[e.trajectory_id, e.start, e.digest.hex()] for e in entries],
            "shards": sorted({e.shard_key for e in entries}),
        }
    ).encode()


def parse_tombstone(data: bytes) -> Tombstone:
    record = json.loads(data)
    return Tombstone(
        record["namespace"],
        [(tid, int(start), bytes.fromhex(digest)) for tid, start, digest in record["segments"]],
        list(record.get("shards", [])),
    )


def read_tombstone(store: ObjectStore, key: str) -> Tombstone | None:
    """The tombstone stored at `key`; None when it is gone (collected meanwhile)."""
    try:
        return parse_tombstone(store.get(key))
    except ObjectNotFound:
        return None


def read_tombstones(store: ObjectStore) -> set[Dropped]:
    """(namespace, trajectory id, start, digest) of every segment retention dropped."""
    dropped: set[Dropped] = set()
    for info in store.list(TOMBSTONE_PREFIX):
        found = read_tombstone(store, info.key)
        if found is None:  # collected meanwhile: its shards are gone too
            continue
        dropped.update((found.namespace, tid, start, d) for tid, start, d in found.segments)
    return dropped
