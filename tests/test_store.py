"""One conformance suite for every ObjectStore backend (S3 on a real SeaweedFS server)."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from r3store.errors import InvalidInput, ObjectExists, ObjectNotFound, StoreError
from r3store.store import ByteRange, LocalStore, ObjectStore, S3Config, S3Store
from r3store.testing.seaweedfs import SeaweedFS


def test_put_get_and_overwrite(store: ObjectStore) -> None:
    store.put("a/b.bin", b"hello")
    assert store.get("a/b.bin") == b"hello"
    store.put("a/b.bin", b"bye")
    assert store.get("a/b.bin") == b"bye"
    assert store.head("a/b.bin").size == 3


def test_range_get(store: ObjectStore) -> None:
    data = bytes(range(256)) * 10
    store.put("r", data)
    assert store.get("r", ByteRange(0, 1)) == data[:1]
    assert store.get("r", ByteRange(100, 356)) == data[100:356]
    assert store.get("r", ByteRange(2550, 2560)) == data[2550:]
    assert store.get("r", ByteRange(2550, 9999)) == data[2550:]


def test_missing_objects(store: ObjectStore) -> None:
    with pytest.raises(ObjectNotFound):
        store.get("nope")
    with pytest.raises(ObjectNotFound):
        store.get("nope", ByteRange(0, 10))
    with pytest.raises(ObjectNotFound):
        store.head("nope")
    store.delete("nope")  # deleting what is not there is fine


def test_put_if_absent_refuses_to_overwrite(store: ObjectStore) -> None:
    store.put_if_absent("once", b"first")
    with pytest.raises(ObjectExists):
        store.put_if_absent("once", b"second")
    assert store.get("once") == b"first"


def test_put_if_absent_race_has_one_winner(store: ObjectStore) -> None:
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
    assert store.get("contested") == f"writer {winners[0]}".encode()


def test_list_by_prefix_in_key_order(store: ObjectStore) -> None:
    for key in ["x/2", "x/1", "x/sub/3", "y/1", "xz"]:
        store.put(key, key.encode())
    assert [o.key for o in store.list("x/")] == ["x/1", "x/2", "x/sub/3"]
    assert [o.key for o in store.list("x")] == ["x/1", "x/2", "x/sub/3", "xz"]
    assert {o.key: o.size for o in store.list("y/")} == {"y/1": 3}
    assert list(store.list("none/")) == []


def test_delete(store: ObjectStore) -> None:
    store.put("d/1", b"1")
    store.delete("d/1")
    with pytest.raises(ObjectNotFound):
        store.get("d/1")
    assert list(store.list("d/")) == []


@pytest.mark.parametrize("key", ["", "/abs", "a/../b", "a//b", "a b", "../up", "a/./b"])
def test_bad_keys_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(InvalidInput):
        store.put(key, b"x")


def test_empty_and_binary_objects(store: ObjectStore) -> None:
    payload = bytes([0, 255, 10, 13]) * 1000
    store.put("bin", payload)
    assert store.get("bin") == payload
    store.put("empty", b"")
    assert store.get("empty") == b""


def test_ping(store: ObjectStore) -> None:
    store.ping()


def test_local_store_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    store.put_if_absent("a/c", b"2")
    with pytest.raises(ObjectExists):
        store.put_if_absent("a/c", b"3")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b", "c"]


def test_s3_multipart_upload_and_its_condition(seaweed: SeaweedFS) -> None:
    mib = 1024 * 1024
    store = seaweed.new_store(multipart_threshold=5 * mib, part_size=5 * mib)
    data = bytes(range(256)) * (48 * 1024)  # 12 MiB: three parts
    store.put_if_absent("big", data)
    assert store.get("big") == data
    assert store.get("big", ByteRange(6 * mib - 3, 6 * mib + 3)) == data[6 * mib - 3 : 6 * mib + 3]
    with pytest.raises(ObjectExists):
        store.put_if_absent("big", data[::-1])
    assert store.get("big", ByteRange(0, 16)) == data[:16]


def test_s3_errors_are_translated(seaweed: SeaweedFS) -> None:
    wrong_secret = S3Store(
        S3Config(
            bucket="r3store-test",
            endpoint_url=seaweed.endpoint_url,
            access_key_id=seaweed.access_key_id,
            secret_access_key="wrong",
            max_attempts=1,
        )
    )
    with pytest.raises(StoreError):
        wrong_secret.put("k", b"v")
    nowhere = S3Store(
        S3Config(
            bucket="r3s-x", endpoint_url="http://127.0.0.1:9", max_attempts=1, connect_timeout=0.5
        )
    )
    with pytest.raises(StoreError):
        nowhere.ping()
    with pytest.raises(StoreError):
        nowhere.get("k")
