"""The S3 data path without boto3's request machinery: single GETs and PUTs of objects,
signed with botocore's Signature V4 signer (`S3SigV4Auth`, the credentials of the
store's session, refreshed as they expire) and sent over a urllib3 pool.

boto3 spends about 1.4 ms of CPU on any request, whatever its size (its event hooks,
request and response handlers); signed here, a GET or PUT costs under half of that,
and a direct write's commit makes two of them. Failures read as boto3's do: a lost
connection or a 5xx is tried again (up to `attempts` times, with a short jittered
backoff), and the answer's status and error code become the project's errors.
"""

from __future__ import annotations

import random
import re
import time
from urllib.parse import quote

import urllib3
from botocore.auth import S3SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials

from r3store.errors import InvalidInput, ObjectExists, ObjectNotFound, R3StoreError, StoreError
from r3store.spans import ByteRange

_RETRIED = {500, 502, 503, 504}
_NOT_FOUND = {"NoSuchKey", "404", "NotFound"}
_EXISTS = {"PreconditionFailed", "412", "ConditionalRequestConflict"}
_CODE = re.compile(rb"<Code>([^<]{1,64})</Code>")
NO_BUCKET = "the bucket does not exist: create it before r3store starts (docs/operations.md)"


class SignedRequests:
    """GET and PUT of keys of `bucket` at `endpoint` (path style), signed for `region`."""

    def __init__(
        self,
        endpoint: str,
        bucket: str,
        region: str,
        credentials: Credentials | None,
        attempts: int,
        connect_timeout: float,
        read_timeout: float,
        pool_size: int,
    ) -> None:
        self._base = f"{endpoint.rstrip('/')}/{quote(bucket, safe='')}/"
        self._region = region
        self._credentials = credentials
        self._attempts = max(1, attempts)
        self._pool = urllib3.PoolManager(
            maxsize=pool_size,
            retries=False,
            timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout),
        )

    def get(self, key: str, shown: str, byte_range: ByteRange | None = None) -> bytes:
        """The object under the full key `key` (`shown` in errors), or the bytes of it
        in `byte_range`."""
        headers = {}
        if byte_range is not None:
            headers["Range"] = f"bytes={byte_range.start}-{byte_range.end - 1}"
        return self._send("GET", key, shown, headers, None)

    def put(self, key: str, shown: str, data: bytes | memoryview, conditional: bool) -> None:
        """Store `data` under `key`; `conditional`: only if there is no object yet
        (`ObjectExists` otherwise)."""
        self._send("PUT", key, shown, {"If-None-Match": "*"} if conditional else {}, data)

    def _send(
        self,
        method: str,
        key: str,
        shown: str,
        headers: dict[str, str],
        body: bytes | memoryview | None,
    ) -> bytes:
        url = self._base + quote(key, safe="/~")
        data = None if body is None else bytes(body)
        for attempt in range(self._attempts):
            last = attempt == self._attempts - 1
            try:
                answer = self._pool.request(
                    method,
                    url,
                    body=data,
                    headers=self._signed(method, url, headers, data),
                    preload_content=True,
                    redirect=False,
                )
            except urllib3.exceptions.HTTPError as exc:
                if last:
                    raise StoreError(f"S3 unreachable on {shown!r}: {exc}") from None
            else:
                if answer.status < 300:
                    return bytes(answer.data)
                if answer.status not in _RETRIED or last:
                    raise _error(answer.status, answer.data, shown)
            time.sleep(random.uniform(0, 0.05 * 2**attempt))
        raise StoreError(f"S3 unreachable on {shown!r}")  # not reached: the last raises

    def _signed(
        self, method: str, url: str, headers: dict[str, str], body: bytes | None
    ) -> dict[str, str]:
        if self._credentials is None:  # an anonymous store
            return headers
        request = AWSRequest(method, url, headers=headers, data=b"" if body is None else body)
        S3SigV4Auth(self._credentials.get_frozen_credentials(), "s3", self._region).add_auth(
            request
        )
        return dict(request.headers.items())

    def close(self) -> None:
        self._pool.clear()


def _error(status: int, body: bytes, shown: str) -> R3StoreError:
    """What an S3 error answer means: its code read from the body, then `meaning`."""
    found = _CODE.search(body or b"")
    return meaning(found.group(1).decode("ascii", "replace") if found else "", status, shown)


def meaning(code: str, status: int | str, key: str, detail: str = "") -> R3StoreError:
    """What an S3 error (its `code` and HTTP `status`) means, as the project's error:
    the one reading of S3's errors, for these requests' answers and boto3's."""
    status = str(status)
    shown = f": {detail}" if detail else ""
    if code == "NoSuchBucket":
        return StoreError(f"{NO_BUCKET}: S3 {code} on {key!r}{shown}")
    if code in _NOT_FOUND or status == "404":
        return ObjectNotFound(f"no object {key!r}")
    if code in _EXISTS or status == "412":
        return ObjectExists(f"object {key!r} already exists")
    if code == "InvalidRange" or status == "416":
        return InvalidInput(f"the range asked lies past the end of object {key!r}")
    return StoreError(f"S3 {code or status} on {key!r}{shown}")
