"""Object storage: one small interface, a local-directory and an S3 implementation.

The S3 backend (and boto3) loads only when asked for, so that code reading stores'
interface (the client, the reader) does not pull in boto3.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from r3store.spans import ByteRange
from r3store.storage.store.base import ObjectInfo, ObjectStore
from r3store.storage.store.local import LocalStore

if TYPE_CHECKING:
    from r3store.storage.store.s3 import S3Config, S3Store

__all__ = ["ByteRange", "LocalStore", "ObjectInfo", "ObjectStore", "S3Config", "S3Store"]


def __getattr__(name: str) -> Any:
    if name in ("S3Config", "S3Store"):
        from r3store.storage.store import s3

        return getattr(s3, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
