"""Direct reads from the client's side (`DirectReads`, mixed into `Calls`): the server
plans where the routes lie in the object store, and the client reads the ranges itself,
in parallel (docs/api.md, "Direct reads"); the dictionaries a plan's streams need are
fetched once and kept (direct writes use them too).
"""

from __future__ import annotations

from collections.abc import Sequence

import urllib3

from r3store.errors import R3StoreError, StoreError
from r3store.logic.codec import Dictionaries, Dictionary, load_dictionary
from r3store.policy import Source
from r3store.protocol.models import ReadPlanModel
from r3store.protocol.plans import Fetched, ReadPlan, reads_of
from r3store.records import Batch
from r3store.spans import ByteRange
from r3store.spec import RouteSpec
from r3store_client.call_base import CallBase
from r3store_client.steps import Call, Work


class Replan(Exception):
    """A planned read the object store refused (its URL expired, or its object moved)."""


class DirectReads(CallBase):
    """Read plans and the object store's ranged GETs; mixed into `Calls`."""

    def _plan(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        expires: int = 60,
        source: Source | None = None,
    ) -> Call[ReadPlan]:
        """Where the routes of `ids` lie in the object store, with URLs that read them
        (S3-backed servers; `InvalidInput` from the embedded store)."""
        body = {
            "ids": list(ids),
            "include_stale": include_stale,
            "expires": expires,
            "source": source,
        }
        path = f"/v1/namespaces/{namespace}/routes/plan"
        answer = yield from self._json("POST", path, json=body)
        return ReadPlanModel.model_validate(answer).to_plan()

    def _fetch_direct(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """Like `fetch(..., decode=False)`, the bytes read from the object store itself
        (ranges in parallel): the server only looks them up. URLs that expired or an
        object compacted away meanwhile: planned again, once."""
        for attempt in range(2):
            plan = yield from self._plan(namespace, ids, include_stale, source=source)
            try:
                batch: Batch = yield Work(self._read_planned, (plan,))
                return plan.spec, batch
            except Replan:
                if attempt:
                    raise StoreError("the object store refused the planned reads twice") from None
        raise R3StoreError("unreachable")

    # the object store's GETs (blocking: run as `Work`)

    def _read_planned(self, plan: ReadPlan) -> Batch:
        fetched = self._fetch_objects(plan)
        return reads_of(plan, fetched, self._dictionaries_of(plan))

    def _store_get(self, url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        """One GET of a presigned URL: its status (200 or 206) and body. The one place
        urllib3's errors become the project's: a connection failure or another status is
        a `StoreError`; 403 or 404 (the URL expired, or its object was compacted away)
        asks for a new plan."""
        store, _fetchers = self._direct()
        try:
            # the bytes as stored: a Content-Encoding a writer set is not undone here
            response = store.request("GET", url, headers=headers, decode_content=False)
        except urllib3.exceptions.HTTPError as exc:
            raise StoreError(f"cannot read from the object store: {exc}") from None
        if response.status in (403, 404):
            raise Replan
        if response.status not in (200, 206):
            raise StoreError(f"the object store answered {response.status}")
        return response.status, response.data

    def _dictionaries_of(self, plan: ReadPlan) -> Dictionaries:
        """The dictionaries a plan's streams need: fetched once, checked against their
        digests, and kept (they never change)."""
        return {d.digest: self._dictionary(d.digest, d.url) for d in plan.dictionaries}

    def _dictionary(self, digest: bytes, url: str) -> Dictionary:
        """The dictionary `digest` names, read from a presigned `url` the first time and
        checked against the digest, then kept (a dictionary never changes)."""
        known = self._dictionaries.get(digest)
        if known is None:
            known = load_dictionary(self._store_get(url)[1], digest)
            self._dictionaries[digest] = known
        return known

    def _fetch_objects(self, plan: ReadPlan) -> list[Fetched]:
        """Each object's planned ranges, fetched in parallel (urllib3: about twice as
        fast as httpx on megabyte bodies)."""
        _store, fetchers = self._direct()
        jobs = [(i, r) for i, o in enumerate(plan.objects) for r in o.ranges]

        def get(job: tuple[int, ByteRange]) -> bytes:
            index, byte_range = job
            headers = {"Range": f"bytes={byte_range.start}-{byte_range.end - 1}"}
            status, data = self._store_get(plan.objects[index].url, headers)
            if status == 200:  # the whole object: a store that ignores Range
                data = data[byte_range.start : byte_range.end]
            if len(data) != byte_range.length:
                raise StoreError("the object store returned a short range")
            return data

        fetched = [Fetched() for _ in plan.objects]
        for (index, byte_range), data in zip(jobs, fetchers.map(get, jobs), strict=True):
            fetched[index].add(byte_range, data)
        return fetched
