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
import time
from collections.abc import Callable, Sequence
from typing import Any

import urllib3

from r3store.errors import DirectUnavailable, PlanGone, R3StoreError, StoreError
from r3store.logic.codec import Dictionary
from r3store.protocol.direct import BlobUploadModel, WriteCommitted, WritePlanModel, pack
from r3store.protocol.models import PutItem
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store_client.direct_reads import DirectReads, Replan
from r3store_client.steps import Call, Work

log = logging.getLogger("r3store_client")


PLAN_MARGIN = 60.0  # seconds a pooled plan must still work to be used
MAX_POOLED = 64  # plans kept per namespace
PLAN_BATCH = 8  # plans a commit asks for when fewer than a quarter of that are left


class _Refused(Exception):
    """The store refused a plan's URL (it expired, or its key exists: an earlier try of
    the PUT may have landed, or not; the blob is never committed unseen): a new plan."""


class DirectWrites(DirectReads):
    """The direct half of `WriteCalls._put`; mixed into `Calls`."""

    def _plan_dictionary(self, plan: WritePlanModel) -> Dictionary | None:
        """The dictionary a write plan names, or None when it names none or it cannot be
        read (the routes then go without one, as before the namespace had one)."""
        if plan.dictionary is None:
            return None
        try:
            return self._dictionary(bytes.fromhex(plan.dictionary.digest), plan.dictionary.url)
        except (Replan, R3StoreError) as exc:
            log.warning(
                "r3store: the namespace's dictionary is not used: %s", exc or "refused by the store"
            )
            return None

    def _chooses_direct(self) -> bool:
        """Whether the next put should try a write plan."""
        if self.direct_writes is not None:
            return self.direct_writes
        return self._writes_direct is not False

    def _chose(self, direct: bool, why: str) -> None:
        if self._writes_direct is None:
            log.info("r3store: %s", why)
        self._writes_direct = direct

    def _next_plan(self, namespace: str) -> WritePlanModel | None:
        """An unused plan of `namespace` a commit answered, with a minute left at least."""
        with self._plans_lock:
            pool = self._plans.get(namespace, [])
            while pool:
                plan = pool.pop()
                if plan.expires_at - time.time() > PLAN_MARGIN:
                    return plan
        return None

    def _keep_plan(self, namespace: str, plan: WritePlanModel) -> None:
        with self._plans_lock:
            pool = self._plans.setdefault(namespace, [])
            if len(pool) < MAX_POOLED:
                pool.append(plan)

    def _plans_wanted(self, namespace: str) -> int:
        """How many plans a commit should answer: a batch when the pool runs low (the
        server makes them in one transaction), else none."""
        with self._plans_lock:
            left = len(self._plans.get(namespace, []))
        return PLAN_BATCH if left < PLAN_BATCH // 4 else 0

    def _write_plan(self, namespace: str) -> Call[WritePlanModel | None]:
        """A pooled plan of `namespace`, else a new one from the server; None when the
        server takes no direct writes (chosen then, unless `direct_writes` insists)."""
        plan = self._next_plan(namespace)
        if plan is None:
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
        self._seen_plans[namespace] = plan
        return plan

    def _last_plan(self, namespace: str) -> Call[WritePlanModel | None]:
        """The last write plan of `namespace` this client used, for the dictionary it
        names and its `max_bytes` (not for its URL); else a new one, kept in the pool
        for the put that goes. None when the server takes no direct writes."""
        seen = self._seen_plans.get(namespace)
        if seen is not None:
            return seen
        plan = yield from self._write_plan(namespace)
        if plan is not None:
            self._keep_plan(namespace, plan)
        return plan

    def _put_direct(
        self,
        namespace: str,
        spec: RouteSpec,
        writes: Sequence[TrajectoryWrite],
        encoded_writes: Callable[..., list[TrajectoryWrite]],
    ) -> Call[list[PutItem] | None]:
        """The server's answer to a direct write of `writes` (shapes checked), or None
        when the server does not take direct writes (then the put goes through it). The
        routes are encoded (`encoded_writes`, as `Work`) with the namespace's dictionary
        when the plan names one. A plan is used once: a PUT refused (expired, or its key
        taken) gets a new plan."""
        packed: tuple[bytes | None, bytes, list[Any]] | None = None  # dictionary, blob, segments
        for attempt in range(3):
            plan = yield from self._write_plan(namespace)
            if plan is None:
                return None
            dictionary = yield Work(self._plan_dictionary, (plan,))
            digest = None if dictionary is None else dictionary.digest
            if packed is None or packed[0] != digest:
                encoded = yield Work(encoded_writes, (list(writes), spec, dictionary))
                packed = (digest, *(yield Work(pack, (encoded,))))
            _digest, blob, segments = packed
            if len(blob) > plan.max_bytes:
                self._keep_plan(namespace, plan)
                return None  # too large for one blob: through the server, in one upload
            writes_at = f"/v1/namespaces/{namespace}/writes"
            body: dict[str, Any] = {"plan": plan.plan, "size": len(blob)}
            try:
                upload = BlobUploadModel.model_validate(
                    (yield from self._json("POST", f"{writes_at}/upload", json=body))
                )
                yield Work(self._store_put, (upload.url, upload.headers, blob))
                self._chose(True, "writes go straight to the object store (direct writes)")
                body["segments"] = [s.model_dump(mode="json", exclude_none=True) for s in segments]
                body["next_plans"] = self._plans_wanted(namespace)
                committed = yield from self._json("POST", f"{writes_at}/commit", json=body)
            except _Refused:
                if attempt == 2:
                    raise StoreError("the object store refused three write plans' URLs") from None
                continue
            except PlanGone:
                # a pooled plan the server forgot (its namespace was deleted and made
                # again, say), or its dictionary collected: the others are as old; a new
                # plan, a new upload (encoded again, with the dictionary it names)
                with self._plans_lock:
                    self._plans.pop(namespace, None)
                if digest is not None:
                    self._dictionaries.pop(digest, None)
                if attempt == 2:
                    raise
                continue
            answer = WriteCommitted.model_validate(committed)
            for following in answer.next:
                self._keep_plan(namespace, following)
            return answer.results
        raise StoreError("unreachable")

    def _store_put(self, url: str, headers: dict[str, str], blob: bytes) -> None:
        """PUT a blob to a plan's URL, retried on a failed connection; 403 (expired) and
        412 (the key exists) ask for a new plan."""
        store, _fetchers = self._direct()
        for attempt in range(3):
            try:
                response = store.request("PUT", url, body=blob, headers=headers)
            except urllib3.exceptions.HTTPError as exc:
                if attempt == 2:
                    raise StoreError(f"cannot write to the object store: {exc}") from None
                continue
            if response.status in (200, 201, 204):
                return
            if response.status in (403, 412):
                raise _Refused
            if response.status >= 500 and attempt < 2:
                continue
            raise StoreError(f"the object store answered {response.status} to a planned write")
