"""Where things live in the object store: every key r3store writes.

    r3store.json                                      the store's identity (its catalog)
    namespaces/<namespace>.json                       a namespace's manifest
    shards/<namespace>/<ms>-<uuid>.parquet            an immutable shard
    shards/<namespace>/<ms>-<uuid>.blob               a direct write's streams, as uploaded
    indexes/<namespace>/<ms>-<uuid>/<ms>-<uuid>.json  the rows the server checked in a blob
    tombstones/<namespace>/<ms>-<uuid>.json           segments retention dropped
    dictionaries/<namespace>/<digest>.zdict           a zstd dictionary (by content)

Keys are unique (time and a UUID, or the content's digest) and written create-only, so
no writer overwrites another's object.
"""

from __future__ import annotations

import time
import uuid

NAMESPACE_PREFIX = "namespaces/"
SHARD_PREFIX = "shards/"
TOMBSTONE_PREFIX = "tombstones/"
INDEX_PREFIX = "indexes/"
BLOB_SUFFIX = ".blob"
DICTIONARY_PREFIX = "dictionaries/"
IDENTITY_KEY = "r3store.json"


def namespace_key(name: str) -> str:
    return f"{NAMESPACE_PREFIX}{name}.json"


def _stamp(now: float | None) -> str:
    ms = int((time.time() if now is None else now) * 1000)
    return f"{ms:013d}-{uuid.uuid4().hex}"


def shard_key(namespace: str, now: float | None = None) -> str:
    """A unique, time-ordered shard key."""
    return f"{SHARD_PREFIX}{namespace}/{_stamp(now)}.parquet"


def blob_key(namespace: str, now: float | None = None) -> str:
    """A unique, time-ordered key for a direct write's object (a shard of its own)."""
    return f"{SHARD_PREFIX}{namespace}/{_stamp(now)}{BLOB_SUFFIX}"


def is_blob(key: str) -> bool:
    return key.startswith(SHARD_PREFIX) and key.endswith(BLOB_SUFFIX)


def index_key(blob: str, now: float) -> str:
    """A new index of the blob `blob` (one per commit that wrote one)."""
    stem = blob.removeprefix(SHARD_PREFIX).removesuffix(BLOB_SUFFIX)
    return f"{INDEX_PREFIX}{stem}/{_stamp(now)}.json"


def blob_of_index(key: str) -> str | None:
    """The blob an index key names, or None for any other key."""
    if not key.startswith(INDEX_PREFIX) or not key.endswith(".json"):
        return None
    stem, _, _name = key.removeprefix(INDEX_PREFIX).rpartition("/")
    return f"{SHARD_PREFIX}{stem}{BLOB_SUFFIX}" if "/" in stem else None


def tombstone_key(namespace: str, now: float) -> str:
    return f"{TOMBSTONE_PREFIX}{namespace}/{_stamp(now)}.json"


def dictionary_key(namespace: str, digest: bytes) -> str:
    """Where a namespace's zstd dictionary lies: named by its digest (SHA-256[:16])."""
    return f"{DICTIONARY_PREFIX}{namespace}/{digest.hex()}.zdict"


def parse_dictionary_key(key: str) -> tuple[str, bytes] | None:
    """(namespace, digest) of a dictionary's key, or None for any other key."""
    namespace, _, name = key.removeprefix(DICTIONARY_PREFIX).rpartition("/")
    if not key.startswith(DICTIONARY_PREFIX) or not name.endswith(".zdict"):
        return None
    try:
        return namespace, bytes.fromhex(name.removesuffix(".zdict"))
    except ValueError:
        return None
