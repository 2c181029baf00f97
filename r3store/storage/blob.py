"""Blobs: the objects direct writes upload, their segments' streams one after another,
and the indexes the server writes beside them once it has checked them.

A blob (`shards/<ns>/<stamp>.blob`) is a shard of its own to the catalog and the
readers, who need only byte spans; it holds no metadata. Before the catalog commits a
blob's rows, the server writes an index (`indexes/<ns>/<blob stamp>/<stamp>.json`,
create-only): the rows as committed (metadata, digest, spans), so that a rebuild finds
them from the store alone. A blob with no index was never committed (an orphan
collection deletes); one commit retried or raced may leave several indexes of one blob,
whose rows a rebuild reads once each. `write_index` writes one; `read_blob` reads a
blob and its indexes back as a `ReadShard`, the form `read_shard` gives a Parquet shard.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from r3store.errors import CorruptShard
from r3store.records import check_source
from r3store.spans import RouteSpans, Span
from r3store.spec import RouteSpec
from r3store.storage.keys import index_key
from r3store.storage.shard import ReadRow, ReadShard, RowPlace, ShardRow
from r3store.storage.store.base import ObjectStore

FORMAT = "r3store.blob-index"
VERSION = 1


def write_index(
    store: ObjectStore,
    blob: str,
    namespace: str,
    spec: RouteSpec,
    created_at: float,
    rows: Sequence[ShardRow],
    spans: Sequence[RouteSpans],
    now: float,
) -> str:
    """Store a new index (create-only) of `rows` of `blob`, whose streams lie at
    `spans`; returns its key."""
    body = {
        "format": FORMAT,
        "version": VERSION,
        "blob": blob,
        "namespace": namespace,
        "spec": json.loads(spec.to_json()),
        "created_at": created_at,
        "rows": [
            {
                "trajectory_id": r.trajectory_id,
                "start": r.start,
                "group_id": r.group_id,
                "policy_version": r.policy_version,
                "num_tokens": r.num_tokens,
                "prompt_len": r.prompt_len,
                "source": r.source,
                "digest": r.digest.hex(),
                "writer": r.writer,
                **s.to_json(),
            }
            for r, s in zip(rows, spans, strict=True)
        ],
    }
    key = index_key(blob, now)
    store.put_if_absent(key, json.dumps(body, separators=(",", ":")).encode())
    return key


def _index(data: bytes, key: str) -> dict[str, Any]:
    try:
        body = json.loads(data)
    except ValueError as exc:
        raise CorruptShard(f"{key}: not JSON: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        raise CorruptShard(f"{key}: not a blob index")
    if body.get("version") != VERSION:
        raise CorruptShard(f"{key}: blob index version {body.get('version')!r}; this build reads 1")
    return body


def read_blob(blob: str, data: bytes, indexes: Sequence[tuple[str, bytes]]) -> ReadShard:
    """A blob's rows as its indexes (`(key, bytes)` each) name them, each row once."""
    if not indexes:
        raise CorruptShard(f"{blob}: no index")
    rows: list[ReadRow] = []
    seen: set[tuple[str, str, int]] = set()
    namespace, spec, created = "", None, 0.0
    for key, raw in indexes:
        body = _index(raw, key)
        try:
            namespace, created = str(body["namespace"]), float(body["created_at"])
            spec = RouteSpec.from_json(json.dumps(body["spec"]))
            for item in body["rows"]:
                unit = (str(item["trajectory_id"]), str(item["source"]), int(item["start"]))
                if unit in seen:
                    continue
                seen.add(unit)
                spans = RouteSpans.from_json(item)
                for span in spans.spans:
                    if span.end > len(data):
                        raise CorruptShard(f"{key}: a span lies past the end of {blob}")

                def read(span: Span) -> bytes:
                    return data[span.offset : span.end]

                row = ShardRow(
                    unit[0],
                    unit[2],
                    item["group_id"],
                    int(item["policy_version"]),
                    int(item["num_tokens"]),
                    int(item["prompt_len"]),
                    spans.streams(read, bytes.fromhex(item["digest"])),
                    check_source(unit[1]),
                    writer=item.get("writer"),
                )
                rows.append(ReadRow(row, RowPlace(0, len(rows)), spans))
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptShard(f"{key}: {exc}") from None
    assert spec is not None
    return ReadShard(namespace, spec, created, None, rows)
