"""The object store interface that shards are written to and read from."""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass

from r3store.errors import InvalidInput
from r3store.spans import ByteRange

_KEY = re.compile(r"^[A-Za-z0-9._\-]+(/[A-Za-z0-9._\-]+)*$")


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    modified: float  # seconds since the epoch


def check_key(key: str) -> str:
    """Keys are `/`-separated names of letters, digits, `.`, `_` and `-`; no `..`."""
    if not _KEY.match(key) or any(part in (".", "..") for part in key.split("/")):
        raise InvalidInput(f"invalid object key {key!r}")
    return key


class ObjectStore(ABC):
    """Immutable objects by key.

    `put_if_absent` is the create-only write that keeps one writer from overwriting
    another's shard; both backends make it atomic. Errors are the project's own:
    `ObjectNotFound`, `ObjectExists`, `StoreError`.
    """

    @abstractmethod
    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        """The object's bytes, or those in `byte_range` (clipped at the object's end)."""

    @abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key`, replacing what was there, atomically."""

    @abstractmethod
    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        """Store `data` under `key` only if no object has that key; else `ObjectExists`."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo:
        """Size and modification time of one object."""

    @abstractmethod
    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        """Objects whose key starts with `prefix`, in key order."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove the object; deleting a missing key is not an error."""

    signs_urls = False  # whether `presign_get` and `presign_put` hand out URLs

    def presign_get(self, key: str, expires: int) -> str:
        """A URL that reads the object without credentials for `expires` seconds (a
        `Range` header selects bytes); only where `signs_urls`."""
        raise InvalidInput(f"{self.description} hands out no URLs to read objects")

    def presign_put(self, key: str, expires: int, size: int) -> tuple[str, dict[str, str]]:
        """A URL, and the headers to send with it, that writes the object once without
        credentials for `expires` seconds: exactly `size` bytes (any other length is
        refused with 403), create-only (a key that exists is refused with 412), only
        where `signs_urls`."""
        raise InvalidInput(f"{self.description} hands out no URLs to write objects")

    def ping(self) -> None:  # noqa: B027 - optional hook
        """Raise `StoreError` when the store cannot be reached."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""

    @property
    def description(self) -> str:
        return type(self).__name__
