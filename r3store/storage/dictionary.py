"""Zstd dictionaries (`dictionaries/<namespace>/<digest hex>.zdict`, docs/format.md):
the raw dictionary bytes, named by their digest (SHA-256[:16]) and checked against it
when read. Written once (create-only) by maintenance; read by every reader of
streams stored with one."""

from __future__ import annotations

import contextlib

from r3store.errors import ObjectExists
from r3store.logic.codec import Dictionary, load_dictionary
from r3store.storage.keys import dictionary_key
from r3store.storage.store.base import ObjectStore


def write_dictionary(store: ObjectStore, namespace: str, dictionary: Dictionary) -> None:
    """Store `dictionary` (create-only; the same bytes already there are left)."""
    with contextlib.suppress(ObjectExists):  # named by content: the same bytes
        store.put_if_absent(dictionary_key(namespace, dictionary.digest), dictionary.data)


def read_dictionary(store: ObjectStore, namespace: str, digest: bytes) -> Dictionary:
    """The dictionary `digest` names, checked against it."""
    return load_dictionary(store.get(dictionary_key(namespace, digest)), digest)
