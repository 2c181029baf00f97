"""A local-directory object store: the embedded default."""

from __future__ import annotations

import contextlib
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

from r3store.errors import ObjectExists, ObjectNotFound, StoreError
from r3store.spans import ByteRange
from r3store.storage.store.base import ObjectInfo, ObjectStore, check_key

_TMP = ".tmp-"


class LocalStore(ObjectStore):
    """Objects as files under `root`; writes go to a temporary file, are fsynced and
    then renamed (`put`) or hard-linked (`put_if_absent`, which fails atomically if the
    name exists), and the directory is fsynced, so a crash leaves either the whole
    object or none.
    """

    def __init__(self, root: str | Path, fsync: bool = True) -> None:
        self.root = Path(root)
        self.fsync = fsync
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def description(self) -> str:
        return f"local directory {self.root}"

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        path = self._path(key)
        try:
            with path.open("rb") as f:
                if byte_range is None:
                    return f.read()
                f.seek(byte_range.start)
                return f.read(byte_range.length)
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {key!r}") from exc
        except OSError as exc:
            raise StoreError(f"cannot read {key!r}: {exc}") from exc

    def _write_temp(self, path: Path, data: bytes | memoryview) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f"{_TMP}{uuid.uuid4().hex}"
        with temp.open("wb") as f:
            f.write(data)
            if self.fsync:
                f.flush()
                os.fsync(f.fileno())
        return temp

    def _sync_dir(self, path: Path) -> None:
        if not self.fsync:
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            temp = self._write_temp(path, data)
            os.replace(temp, path)
            self._sync_dir(path.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {key!r}: {exc}") from exc

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        try:
            temp = self._write_temp(path, data)
            try:
                os.link(temp, path)
            except FileExistsError as exc:
                raise ObjectExists(f"object {key!r} already exists") from exc
            finally:
                temp.unlink()
            self._sync_dir(path.parent)
        except OSError as exc:
            raise StoreError(f"cannot write {key!r}: {exc}") from exc

    def head(self, key: str) -> ObjectInfo:
        try:
            st = self._path(key).stat()
        except FileNotFoundError as exc:
            raise ObjectNotFound(f"no object {key!r}") from exc
        return ObjectInfo(key, st.st_size, st.st_mtime)

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        found: list[ObjectInfo] = []
        for dirpath, _dirs, files in os.walk(self.root):
            for name in files:
                if name.startswith(_TMP):
                    continue
                full = Path(dirpath) / name
                key = full.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    with contextlib.suppress(FileNotFoundError):
                        st = full.stat()
                        found.append(ObjectInfo(key, st.st_size, st.st_mtime))
        yield from sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        try:
            self._path(key).unlink()
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"cannot delete {key!r}: {exc}") from exc

    def ping(self) -> None:
        if not self.root.is_dir():
            raise StoreError(f"data directory {self.root} is missing")
