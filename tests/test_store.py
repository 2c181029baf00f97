"""The conformance suite (`r3store.testing.store`) on every ObjectStore backend, checked
through the backend itself (files, boto3), S3 on a real SeaweedFS server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import boto3
import pytest

from r3store.errors import ObjectExists, StoreError
from r3store.spans import ByteRange
from r3store.storage.store import LocalStore, ObjectStore, S3Config, S3Store
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.store import StoreTests


class TestLocalStore(StoreTests):
    @pytest.fixture
    def store(self, tmp_path: Path) -> Iterator[ObjectStore]:
        made = LocalStore(tmp_path / "objects")
        yield made
        made.close()

    def _root(self, store: ObjectStore) -> Path:
        assert isinstance(store, LocalStore)
        return store.root

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        path = self._root(store) / key
        return path.read_bytes() if path.is_file() else None

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        path = self._root(store) / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def raw_keys(self, store: ObjectStore) -> set[str]:
        root = self._root(store)
        return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()}


@pytest.mark.s3
class TestS3Store(StoreTests):
    @pytest.fixture
    def store(self, seaweed: SeaweedFS) -> Iterator[ObjectStore]:
        made = seaweed.new_store()
        self.raw = boto3.client(
            "s3",
            endpoint_url=seaweed.endpoint_url,
            region_name="us-east-1",
            aws_access_key_id=seaweed.access_key_id,
            aws_secret_access_key=seaweed.secret_access_key,
        )
        yield made
        made.close()
        self.raw.close()

    def _where(self, store: ObjectStore) -> tuple[str, str]:
        assert isinstance(store, S3Store)
        return store.bucket, store.config.prefix.strip("/") + "/"

    def raw_get(self, store: ObjectStore, key: str) -> bytes | None:
        bucket, prefix = self._where(store)
        try:
            data: bytes = self.raw.get_object(Bucket=bucket, Key=prefix + key)["Body"].read()
        except self.raw.exceptions.NoSuchKey:
            return None
        return data

    def raw_put(self, store: ObjectStore, key: str, data: bytes) -> None:
        bucket, prefix = self._where(store)
        self.raw.put_object(Bucket=bucket, Key=prefix + key, Body=data)

    def raw_keys(self, store: ObjectStore) -> set[str]:
        bucket, prefix = self._where(store)
        pages = self.raw.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        return {item["Key"][len(prefix) :] for page in pages for item in page.get("Contents", [])}


def test_local_store_leaves_no_temporary_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put("a/b", b"1")
    store.put_if_absent("a/c", b"2")
    with pytest.raises(ObjectExists):
        store.put_if_absent("a/c", b"3")
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["b", "c"]


@pytest.mark.s3
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


@pytest.mark.s3
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
    missing = S3Store(
        S3Config(
            bucket="r3store-no-such-bucket",
            endpoint_url=seaweed.endpoint_url,
            access_key_id=seaweed.access_key_id,
            secret_access_key=seaweed.secret_access_key,
            max_attempts=1,
        )
    )
    with pytest.raises(StoreError, match="the bucket does not exist"):  # not a missing key
        missing.get("k")  # (SeaweedFS makes a bucket on a PUT: only reads can show it)
