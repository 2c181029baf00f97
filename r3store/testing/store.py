"""A conformance suite for `ObjectStore` backends, checked from the outside.

Subclass `StoreTests` with a `store` fixture and the backdoors that read and write the
backend directly (files, boto3), bypassing the store under test, and pytest runs every
check on that backend:

    class TestLocalStore(StoreTests):
        @pytest.fixture
        def store(self, tmp_path): ...
        def raw_get(self, store, key): ...     # the object's bytes, or None
        def raw_put(self, store, key, data): ...
        def raw_keys(self, store): ...         # every key the backend holds

A store that only agreed with itself (writing and reading the same wrong place, say)
fails these.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod

import pytest

from r3store.errors import InvalidInput, ObjectExists, ObjectNotFound
from r3store.spans import ByteRange
from r3store.storage.store.base import ObjectStore


class StoreTests(ABC):
    """The checks every backend passes; see the module docstring."""

    @abstractmethod
    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        """The bytes the backend holds under `key`, read around the store."""

    @abstractmethod
    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        """Write `data` under `key` around the store."""

    @abstractmethod
    def raw_keys(self, store: ObjectStore) -> set[str]:
        """Every key the backend holds, listed around the store."""

    def test_put_lands_where_the_backend_keeps_it(self, store: ObjectStore) -> None:
        store.put("a/b.bin", b"hello")
        assert self.raw_get(store, "a/b.bin") == b"hello"
        store.put("a/b.bin", b"bye")
        assert self.raw_get(store, "a/b.bin") == b"bye"
        assert self.raw_keys(store) == {"a/b.bin"}

    def test_get_reads_what_the_backend_holds(self, store: ObjectStore) -> None:
        data = bytes(range(256)) * 10
        self.raw_put(store, "r", data)
        assert store.get("r") == data
        assert store.head("r").size == len(data)
        assert store.get("r", ByteRange(0, 1)) == data[:1]
        assert store.get("r", ByteRange(100, 356)) == data[100:356]
        assert store.get("r", ByteRange(2550, 2560)) == data[2550:]
        assert store.get("r", ByteRange(2550, 9999)) == data[2550:]

    def test_missing_objects(self, store: ObjectStore) -> None:
        with pytest.raises(ObjectNotFound):
            store.get("nope")
        with pytest.raises(ObjectNotFound):
            store.get("nope", ByteRange(0, 10))
        with pytest.raises(ObjectNotFound):
            store.head("nope")
        store.delete("nope")  # deleting what is not there is fine

    def test_put_if_absent_refuses_to_overwrite(self, store: ObjectStore) -> None:
        self.raw_put(store, "taken", b"someone else's")
        with pytest.raises(ObjectExists):
            store.put_if_absent("taken", b"mine")
        assert self.raw_get(store, "taken") == b"someone else's"
        store.put_if_absent("free", b"first")
        assert self.raw_get(store, "free") == b"first"

    def test_put_if_absent_race_has_one_winner(self, store: ObjectStore) -> None:
        winners: list[int] = []
        losers: list[int] = []
        barrier = threading.Barrier(8)

        def attempt(i: int) -> None:
            barrier.wait()
            try:
                store.put_if_absent("contested", f"writer {i}".encode())
                winners.append(i)
            except ObjectExists:
                losers.append(i)

        threads = [threading.Thread(target=attempt, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert len(winners) == 1
        assert len(losers) == 7
        assert self.raw_get(store, "contested") == f"writer {winners[0]}".encode()

    def test_list_by_prefix_in_key_order(self, store: ObjectStore) -> None:
        for key in ["x/2", "x/1", "x/sub/3", "y/1", "xz"]:
            self.raw_put(store, key, key.encode())
        assert [o.key for o in store.list("x/")] == ["x/1", "x/2", "x/sub/3"]
        assert [o.key for o in store.list("x")] == ["x/1", "x/2", "x/sub/3", "xz"]
        assert {o.key: o.size for o in store.list("y/")} == {"y/1": 3}
        assert list(store.list("none/")) == []

    def test_delete_removes_it_from_the_backend(self, store: ObjectStore) -> None:
        self.raw_put(store, "d/1", b"1")
        self.raw_put(store, "d/2", b"2")
        store.delete("d/1")
        assert self.raw_get(store, "d/1") is None
        assert self.raw_keys(store) == {"d/2"}

    @pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "a b", "../up", "a/./b"])
    def test_bad_keys_are_refused(self, store: ObjectStore, key: str) -> None:
        with pytest.raises(InvalidInput):
            store.put(key, b"x")
        assert self.raw_keys(store) == set()

    def test_empty_and_binary_objects(self, store: ObjectStore) -> None:
        payload = bytes([0, 255, 10, 13]) * 1000
        store.put("bin", payload)
        store.put("empty", b"")
        assert self.raw_get(store, "bin") == payload
        assert self.raw_get(store, "empty") == b""
        assert store.get("empty") == b""

    def test_ping(self, store: ObjectStore) -> None:
        store.ping()

    def test_presigned_urls(self, store: ObjectStore) -> None:
        """Where the store signs URLs (direct writes and reads rely on them): a GET URL
        reads the object, a `Range` its bytes; a PUT URL writes a new object once, of
        the length it was signed for and only with its headers (403 otherwise), and a
        second PUT of the key is refused (412), the first one's bytes kept. A store that
        signs none refuses to."""
        if not store.signs_urls:
            with pytest.raises(InvalidInput):
                store.presign_put("p/new.blob", 60, 5)
            with pytest.raises(InvalidInput):
                store.presign_get("p/new.blob", 60)
            return
        import urllib3

        http = urllib3.PoolManager()
        url, headers = store.presign_put("p/new.blob", 60, 5)
        assert http.request("PUT", url, body=b"bare!").status == 403  # without its headers
        for other in (b"longer", b"four", b"first" * 1000):  # another length than signed
            assert http.request("PUT", url, body=other, headers=headers).status == 403
        assert self.raw_get(store, "p/new.blob") is None
        assert http.request("PUT", url, body=b"first", headers=headers).status in (200, 201)
        assert self.raw_get(store, "p/new.blob") == b"first"
        assert http.request("PUT", url, body=b"again", headers=headers).status == 412
        assert self.raw_get(store, "p/new.blob") == b"first"
        read = http.request(
            "GET", store.presign_get("p/new.blob", 60), headers={"Range": "bytes=1-3"}
        )
        assert read.data == b"irs"
