"""Judging a server's answers to hostile uploads (`r3store.testing.arrow_fuzz`).

    judge = UploadJudge(url, api_key, "fuzz", FUZZ_SPEC, process)
    verdict = judge.judge(body)      # "rejected", "accepted", or a failure

A rejection must be a 4xx with a clear error (`code` and `message`, never `internal`)
that changed nothing; an acceptance must store exactly the routes the body holds, read
back and compared; anything else (a 5xx, a dropped connection, a dead process, a
rejection that stored something) is a failure. Shared by the test suite and the
benchmark, which counts verdicts over thousands of bodies.
"""

from __future__ import annotations

import subprocess
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3store.engine import Engine
from r3store.errors import R3StoreError
from r3store.protocol.wire import CONTENT_TYPE, decode_batch, decode_writes
from r3store.spec import RouteSpec
from r3store.testing.arrow_fuzz import Chooser, base_bodies, mutate

OK = ("rejected", "accepted")


@dataclass(frozen=True)
class Verdict:
    kind: str  # "rejected", "accepted", "server_error", "died", "dropped", "changed", "wrong"
    status: int | None
    detail: str

    @property
    def ok(self) -> bool:
        return self.kind in OK


@dataclass
class Tally:
    cases: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    mutations: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    def add(self, mutation: str, verdict: Verdict) -> None:
        self.cases += 1
        self.kinds[verdict.kind] += 1
        self.statuses[f"{verdict.status // 100}xx" if verdict.status else "none"] += 1
        self.mutations[mutation] += 1
        if not verdict.ok and len(self.failures) < 20:
            self.failures.append(f"{mutation}: {verdict.kind} {verdict.status} {verdict.detail}")

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "4xx": self.statuses["4xx"],
            "5xx": self.statuses["5xx"],
            "accepted": self.kinds["accepted"],
            "process_deaths": self.kinds["died"],
            "dropped_connections": self.kinds["dropped"],
            "rejections_that_changed_something": self.kinds["changed"],
            "wrong_content_stored": self.kinds["wrong"],
            "failures": self.failures,
        }


class UploadJudge:
    def __init__(
        self,
        url: str,
        api_key: str,
        namespace: str,
        spec: RouteSpec,
        process: subprocess.Popen[bytes],
    ) -> None:
        import httpx

        self.namespace = namespace
        self.spec = spec
        self.process = process
        self.http = httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {api_key}"}, timeout=60
        )
        self._transport_error: type[Exception] = httpx.TransportError

    def close(self) -> None:
        self.http.close()

    def _stored(self) -> int:
        body = self.http.get(f"/v1/namespaces/{self.namespace}").json()
        return int(body["trajectories"])

    def judge(self, body: bytes) -> Verdict:
        try:
            before = self._stored()
        except self._transport_error as exc:  # the last answer left a broken connection
            died = self.process.poll() is not None
            return Verdict("died" if died else "dropped", None, f"before the upload: {exc!r}")
        try:
            r = self.http.post(
                f"/v1/namespaces/{self.namespace}/trajectories",
                content=body,
                headers={"Content-Type": CONTENT_TYPE},
            )
        except self._transport_error as exc:
            died = self.process.poll() is not None
            return Verdict("died" if died else "dropped", None, repr(exc))
        if self.process.poll() is not None:
            return Verdict("died", r.status_code, "")
        if r.status_code >= 500:
            return Verdict("server_error", r.status_code, r.text[:300])
        if r.status_code >= 400:
            try:
                error = r.json()["error"]
                clear = bool(error["message"]) and error["code"] not in ("", "internal")
            except (ValueError, KeyError, TypeError):
                clear = False
            if not clear:
                return Verdict("server_error", r.status_code, f"unclear error: {r.text[:300]}")
            if self._stored() != before:
                return Verdict("changed", r.status_code, r.text[:300])
            return Verdict("rejected", r.status_code, str(error["code"]))
        return self._check_stored(body, r.status_code)

    def _check_stored(self, body: bytes, status: int) -> Verdict:
        """An accepted body: what is read back is exactly what it holds."""
        try:
            writes = decode_writes(body, self.spec)
            expected = [Engine.prepare_routes(self.spec, w) for w in writes]
        except R3StoreError as exc:
            return Verdict("wrong", status, f"accepted a body the client library refuses: {exc}")
        ids = [w.trajectory_id for w in writes]
        answer = self.http.post(
            f"/v1/namespaces/{self.namespace}/routes/batch",
            json={"ids": ids, "include_stale": True},
        )
        batch = decode_batch(answer.content)[1]
        for write, want, item in zip(writes, expected, batch.items, strict=True):
            if item is None or item.routes is None:
                return Verdict("wrong", status, f"{write.trajectory_id} not readable")
            got = item.routes.to_topk()[write.start : write.start + write.num_tokens]
            if not np.array_equal(got, want.to_topk()):
                return Verdict("wrong", status, f"{write.trajectory_id}: other routes stored")
        return Verdict("accepted", status, "")


def campaign(judge: UploadJudge, chooser: Chooser, cases: int) -> Tally:
    """`cases` hostile bodies, judged; the tally of verdicts."""
    bodies = [body for body, _writes in base_bodies()]
    tally = Tally()
    for _ in range(cases):
        mutation, body = mutate(bodies, chooser)
        tally.add(mutation, judge.judge(body))
        if judge.process.poll() is not None:
            break
    return tally
