"""Zstd dictionaries (`dictionaries/<namespace>/<digest hex>.zdict`, docs/format.md):
the raw dictionary bytes, named by their digest (SHA-256[:16]) and checked against it
when read. Written once (create-only) by maintenance; read by every reader of
streams stored with one, through a `DictionaryCache` (the reader, maintenance, a
rebuild)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable

from r3store.errors import ObjectExists
from r3store.logic.codec import load_dictionary
from r3store.logic.lru import LRU
from r3store.route_types import Dictionaries, Dictionary
from r3store.storage.keys import dictionary_key
from r3store.storage.store.base import ObjectStore

DICTIONARY_CACHE_BYTES = 64 << 20


def write_dictionary(store: ObjectStore, namespace: str, dictionary: Dictionary) -> None:
    """Store `dictionary` (create-only; the same bytes already there are left)."""
    with contextlib.suppress(ObjectExists):  # named by content: the same bytes
        store.put_if_absent(dictionary_key(namespace, dictionary.digest), dictionary.data)


def read_dictionary(store: ObjectStore, namespace: str, digest: bytes) -> Dictionary:
    """The dictionary `digest` names, checked against it."""
    return load_dictionary(store.get(dictionary_key(namespace, digest)), digest)


class DictionaryCache:
    """Namespace dictionaries read from the store, checked against the digest they are
    named by, and kept (they never change) up to `capacity` bytes."""

    def __init__(self, store: ObjectStore, capacity: int = DICTIONARY_CACHE_BYTES) -> None:
        self._store = store
        self._kept: LRU[tuple[str, bytes], Dictionary] = LRU(capacity)

    def add(self, namespace: str, dictionary: Dictionary) -> None:
        self._kept.put((namespace, dictionary.digest), dictionary, len(dictionary.data))

    def get(self, namespace: str, digest: bytes | None) -> Dictionary | None:
        """The dictionary `digest` names; None for no digest."""
        return None if digest is None else self._load(namespace, digest)

    def many(self, namespace: str, digests: Iterable[bytes | None]) -> Dictionaries:
        return {d: self._load(namespace, d) for d in set(digests) if d is not None}

    def _load(self, namespace: str, digest: bytes) -> Dictionary:
        kept = self._kept.get((namespace, digest))
        if kept is None:
            kept = read_dictionary(self._store, namespace, digest)
            self.add(namespace, kept)
        return kept
