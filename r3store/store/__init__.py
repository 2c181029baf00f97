"""Object storage: one small interface, a local-directory and an S3 implementation."""

from r3store.store.base import ByteRange, ObjectInfo, ObjectStore
from r3store.store.local import LocalStore
from r3store.store.s3 import S3Config, S3Store

__all__ = ["ByteRange", "LocalStore", "ObjectInfo", "ObjectStore", "S3Config", "S3Store"]
