"""An S3 object store over boto3 (AWS S3, MinIO, SeaweedFS)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from r3store.errors import (
    ObjectExists,
    ObjectNotFound,
    R3StoreError,
    StoreError,
)
from r3store.spans import ByteRange
from r3store.storage.store.base import ObjectInfo, ObjectStore, check_key
from r3store.storage.store.s3_requests import NO_BUCKET, SignedRequests, meaning

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MiB = 1024 * 1024


@dataclass(frozen=True)
class S3Config:
    """Where and how to reach the bucket.

    `S3Config(bucket="r3store", endpoint_url="http://127.0.0.1:9000",
    access_key_id="...", secret_access_key="...")`; leave `endpoint_url` empty for AWS.
    """

    bucket: str
    endpoint_url: str | None = None
    public_endpoint_url: str | None = None  # signed into presigned URLs; None: endpoint_url
    region: str = "us-east-1"
    access_key_id: str | None = None
    secret_access_key: str | None = None
    prefix: str = ""
    max_attempts: int = 5
    connect_timeout: float = 5.0
    read_timeout: float = 60.0
    max_pool_connections: int = 32
    multipart_threshold: int = 64 * MiB
    part_size: int = 16 * MiB


def translate(exc: Exception, key: str) -> R3StoreError:
    """What a boto error means, as the project's error (`s3_requests.meaning`)."""
    if isinstance(exc, ClientError):
        code = str(exc.response.get("Error", {}).get("Code", ""))
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return meaning(code, status, key, str(exc))
    return StoreError(f"S3 unreachable on {key!r}: {exc}")


@contextlib.contextmanager
def _translated(key: str) -> Iterator[None]:
    """The one boundary where boto errors become the project's."""
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise translate(exc, key) from exc


class S3Store(ObjectStore):
    """Objects in one bucket, under an optional key prefix.

    boto3's standard retry mode retries throttling and transient errors with
    exponential backoff. `put_if_absent` sends `If-None-Match: *`, so the server
    refuses to overwrite; objects over `multipart_threshold` go up in parts and the
    condition is checked when the upload completes. Gets and single-part puts, the
    data path, go without boto3's request machinery (`s3_requests`), signed alike.
    """

    def __init__(self, config: S3Config) -> None:
        self.config = config
        self.bucket = config.bucket
        self._prefix = config.prefix.strip("/") + "/" if config.prefix.strip("/") else ""
        self._session = boto3.session.Session(
            aws_access_key_id=config.access_key_id,
            aws_secret_access_key=config.secret_access_key,
            region_name=config.region,
        )
        self._client: S3Client = self._make_client(
            config.max_attempts, config.connect_timeout, config.read_timeout
        )
        # readiness probes must answer fast: one attempt, short timeouts
        self._probe: S3Client = self._make_client(1, 2.0, 2.0)
        # presigned URLs name the endpoint trainers reach, which may not be the server's
        public = config.public_endpoint_url
        # Signature V4, whose presigned writes sign `If-None-Match` (create-only)
        self._signer = self._make_client(1, 2.0, 2.0, public or None, "s3v4")
        self._requests = SignedRequests(
            self._client.meta.endpoint_url,
            config.bucket,
            config.region,
            self._session.get_credentials(),
            config.max_attempts,
            config.connect_timeout,
            config.read_timeout,
            config.max_pool_connections,
        )

    def _make_client(
        self,
        attempts: int,
        connect: float,
        read: float,
        endpoint: str | None = None,
        signature: str | None = None,
    ) -> S3Client:
        config = self.config
        client: S3Client = self._session.client(
            "s3",
            endpoint_url=endpoint or config.endpoint_url or None,
            config=Config(
                retries={"max_attempts": attempts, "mode": "standard"},
                connect_timeout=connect,
                read_timeout=read,
                max_pool_connections=config.max_pool_connections,
                s3={"addressing_style": "path"},
                signature_version=signature,
            ),
        )
        return client

    @property
    def description(self) -> str:
        where = self.config.endpoint_url or "AWS"
        return f"S3 bucket {self.bucket!r} at {where}"

    def _key(self, key: str) -> str:
        return self._prefix + check_key(key)

    signs_urls = True

    def presign_get(self, key: str, expires: int) -> str:
        """A presigned GET of the object (signed here, no request is made)."""
        params = {"Bucket": self.bucket, "Key": self._key(key)}
        with _translated(key):
            url: str = self._signer.generate_presigned_url(
                "get_object", Params=params, ExpiresIn=expires
            )
        return url

    def presign_put(self, key: str, expires: int, size: int) -> tuple[str, dict[str, str]]:
        """A presigned create-only PUT of `size` bytes: `If-None-Match: *` and the
        `Content-Length` are signed into the URL, so the store refuses the request
        without the one, with another length (or chunked), and a second write of the
        key (412)."""
        params = {
            "Bucket": self.bucket,
            "Key": self._key(key),
            "IfNoneMatch": "*",
            "ContentLength": size,
        }
        with _translated(key):
            url: str = self._signer.generate_presigned_url(
                "put_object", Params=params, ExpiresIn=expires
            )
        return url, {"If-None-Match": "*"}

    def get(self, key: str, byte_range: ByteRange | None = None) -> bytes:
        return self._requests.get(self._key(key), key, byte_range)

    def put(self, key: str, data: bytes | memoryview) -> None:
        self._upload(key, data, conditional=False)

    def put_if_absent(self, key: str, data: bytes | memoryview) -> None:
        self._upload(key, data, conditional=True)

    def _upload(self, key: str, data: bytes | memoryview, conditional: bool) -> None:
        full = self._key(key)
        extra: dict[str, Any] = {"IfNoneMatch": "*"} if conditional else {}
        try:
            with _translated(key):
                if len(data) <= self.config.multipart_threshold:
                    self._requests.put(full, key, data, conditional)
                else:
                    self._multipart(full, memoryview(data), extra)
        except (ObjectExists, ObjectNotFound):
            # boto3 retries a request whose answer was lost (a timeout, a dropped
            # connection); when the first attempt had landed, the retry of a create-only
            # put finds the object (412), or the completed multipart upload gone (404)
            if not (conditional and self._holds(key, data)):
                raise

    def _holds(self, key: str, data: bytes | memoryview) -> bool:
        """Whether the object under `key` is exactly `data`."""
        try:
            if self.head(key).size != len(data):
                return False
            return self.get(key) == bytes(data)
        except ObjectNotFound:
            return False

    def _multipart(self, full: str, data: memoryview, extra: dict[str, Any]) -> None:
        upload = self._client.create_multipart_upload(Bucket=self.bucket, Key=full)
        upload_id = upload["UploadId"]
        try:
            parts = []
            size = self.config.part_size
            for number, start in enumerate(range(0, len(data), size), start=1):
                part = self._client.upload_part(
                    Bucket=self.bucket,
                    Key=full,
                    UploadId=upload_id,
                    PartNumber=number,
                    Body=bytes(data[start : start + size]),
                )
                parts.append({"ETag": part["ETag"], "PartNumber": number})
            self._client.complete_multipart_upload(
                Bucket=self.bucket,
                Key=full,
                UploadId=upload_id,
                MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
                **extra,
            )
        except BaseException:
            with contextlib.suppress(ClientError, BotoCoreError):
                self._client.abort_multipart_upload(
                    Bucket=self.bucket, Key=full, UploadId=upload_id
                )
            raise

    def head(self, key: str) -> ObjectInfo:
        with _translated(key):
            meta = self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        return ObjectInfo(key, int(meta["ContentLength"]), meta["LastModified"].timestamp())

    def list(self, prefix: str = "") -> Iterator[ObjectInfo]:
        paginator = self._client.get_paginator("list_objects_v2")
        with _translated(prefix):
            for page in paginator.paginate(Bucket=self.bucket, Prefix=self._prefix + prefix):
                for item in page.get("Contents", []):
                    key = item["Key"][len(self._prefix) :]
                    yield ObjectInfo(key, int(item["Size"]), item["LastModified"].timestamp())

    def delete(self, key: str) -> None:
        with contextlib.suppress(ObjectNotFound), _translated(key):
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))

    def ping(self) -> None:
        """`StoreError` unless the bucket answers; a missing bucket is said so."""
        try:
            with _translated(self.bucket):
                self._probe.head_bucket(Bucket=self.bucket)
        except ObjectNotFound:  # HEAD has no body: a 404 on the bucket is its absence
            raise StoreError(
                f"{self.description}: {NO_BUCKET.replace('the bucket', 'it')}"
            ) from None

    def create_bucket(self) -> None:
        """Create the bucket if it does not exist (for tests and first runs)."""
        with _translated(self.bucket):
            try:
                self._client.create_bucket(Bucket=self.bucket)
            except ClientError as exc:
                code = exc.response.get("Error", {}).get("Code", "")
                if code in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    return
                raise

    def close(self) -> None:
        self._requests.close()
        self._client.close()
        self._probe.close()
        if self._signer is not self._client:
            self._signer.close()
