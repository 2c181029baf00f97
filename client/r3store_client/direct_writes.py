"""Direct writes from the client's side (`DirectWrites`, mixed into `Calls`): a put whose
segments are all encoded here goes to the object store itself, the server only
checking and committing it (docs/api.md, "Direct writes").

`direct_writes=None` (the default) chooses by asking: the first put asks for a write
plan, and a server whose store signs no URLs (the embedded store) answers
`direct_unavailable`, after which puts go through the server; the choice is logged
once. `True` insists (the error is raised), `False` never asks.
"""

from __future__ import annotations

import logging
from collections.abc import Generator, Sequence
from typing import Any

import urllib3

from r3store.errors import DirectUnavailable, StoreError
from r3store.protocol.direct import WritePlanModel, pack
from r3store.records import TrajectoryWrite

log = logging.getLogger("r3store_client")


class _Expired(Exception):
    """The store refused a plan's URL (it expired): ask for another plan."""


class DirectWrites:
    """The direct half of `Calls._put`; `Calls` provides `_json`, `_direct` and the
    settings."""

    direct_writes: bool | None
    _writes_direct: bool | None  # what was chosen (None: not yet)

    def _json(self, method: str, path: str, **kwargs: Any) -> Generator[Any, Any, Any]:
        raise NotImplementedError  # `Calls`

    def _direct(self) -> tuple[urllib3.PoolManager, Any]:
        raise NotImplementedError  # `Calls`

    def _chooses_direct(self) -> bool:
        """Whether the next put should try a write plan."""
        if self.direct_writes is not None:
            return self.direct_writes
        return self._writes_direct is not False

    def _chose(self, direct: bool, why: str) -> None:
        if self._writes_direct is None:
            log.info("r3store: %s", why)
        self._writes_direct = direct

    def _put_direct(
        self, namespace: str, writes: Sequence[TrajectoryWrite], work: Any
    ) -> Generator[Any, Any, dict[str, Any] | None]:
        """The server's answer to a direct write of `writes` (all encoded), or None when
        the server does not take direct writes (then the put goes through it)."""
        blob, segments = yield work(pack, (list(writes),))
        for attempt in range(2):
            try:
                answer = yield from self._json(
                    "POST", f"/v1/namespaces/{namespace}/writes", json={}
                )
            except DirectUnavailable as exc:
                if self.direct_writes:
                    raise
                self._chose(False, f"writes go through the server ({exc})")
                return None
            plan = WritePlanModel.model_validate(answer)
            if len(blob) > plan.max_bytes:
                self._chose(True, "writes go straight to the object store (direct writes)")
                return None  # too large for one blob: through the server, in one upload
            try:
                yield work(self._store_put, (plan.url, plan.headers, blob))
            except _Expired:
                if attempt:
                    raise StoreError("the object store refused two write plans' URLs") from None
                continue
            self._chose(True, "writes go straight to the object store (direct writes)")
            body = {
                "plan": plan.plan,
                "size": len(blob),
                "segments": [s.model_dump(mode="json", exclude_none=True) for s in segments],
            }
            result: dict[str, Any] = yield from self._json(
                "POST", f"/v1/namespaces/{namespace}/writes/commit", json=body
            )
            return result
        raise StoreError("unreachable")

    def _store_put(self, url: str, headers: dict[str, str], blob: bytes) -> None:
        """PUT a blob to a plan's URL, retried on a failed connection; 412 (already
        there: an earlier try of this PUT landed) is success, 403 an expired plan."""
        store, _fetchers = self._direct()
        for attempt in range(3):
            try:
                response = store.request("PUT", url, body=blob, headers=headers)
            except urllib3.exceptions.HTTPError as exc:
                if attempt == 2:
                    raise StoreError(f"cannot write to the object store: {exc}") from None
                continue
            if response.status in (200, 201, 204, 412):
                return
            if response.status == 403:
                raise _Expired
            if response.status >= 500 and attempt < 2:
                continue
            raise StoreError(f"the object store answered {response.status} to a planned write")
