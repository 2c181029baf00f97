"""Fuzzing direct writes (`POST .../writes`, the PUT, `POST .../writes/commit`) against a
real server on SeaweedFS: forged and foreign plans, blobs that lie, spans that do not
fit, streams that are not what they say, metadata of any kind, and valid controls.

    report = run(seaweed, cases=150, seed=1)
    assert report.bad_acks == report.server_errors == report.deaths == 0

A bad commit must be refused with a clear 4xx and make no trajectory readable (the
namespaces' counts and the case's ids are read before and after); a commit the server
may take ("either", `direct_cases.oracle`) must, if taken, serve exactly what its spans
hold; a control must be acknowledged and read back equal. The cases themselves are in
`r3store.testing.direct_cases` and `r3store.testing.direct_mutations`.
"""

from __future__ import annotations

import json
import random
import subprocess
import tempfile
from collections import Counter
from dataclasses import dataclass, field
from json import dumps
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store.engine import Engine
from r3store.errors import R3StoreError
from r3store.protocol.answers import decode_batch
from r3store.records import TrajectoryWrite, check_id
from r3store.storage.keys import INDEX_PREFIX
from r3store.storage.store.base import ObjectStore
from r3store.testing.direct_cases import SPECS, Ctx, Raw, Setup
from r3store.testing.direct_mutations import CASES
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.service import start_server, stop_server

KEYS = {
    "admin": "direct-fuzz-admin-0123456789abcdef",
    "w1": "direct-fuzz-writer-0123456789abcde",
    "w2": "direct-fuzz-writer2-0123456789abcd",
}
ROLES = {"admin": "admin", "w1": "writer", "w2": "writer"}


@dataclass
class DirectFuzzReport:
    cases: int = 0
    bad_acks: int = 0  # rows of bad commits acknowledged (or made readable)
    server_errors: int = 0  # 5xx answers, unclear errors and dropped connections
    deaths: int = 0  # the server process exited, or /healthz stopped answering
    controls: int = 0
    controls_ok: int = 0
    rejected: int = 0  # bad commits refused with a clear 4xx that changed nothing
    setup_failures: int = 0  # a plan, PUT or earlier commit a case needs failed
    by_kind: Counter[str] = field(default_factory=Counter)
    statuses: Counter[str] = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)

    @property
    def all_controls_ok(self) -> bool:
        return self.controls_ok == self.controls

    def fail(self, text: str) -> None:
        if len(self.failures) < 30:
            self.failures.append(text)

    def summary(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "bad_acks": self.bad_acks,
            "server_errors": self.server_errors,
            "deaths": self.deaths,
            "controls": self.controls,
            "controls_ok": self.controls_ok,
            "rejected": self.rejected,
            "setup_failures": self.setup_failures,
            "by_kind": dict(sorted(self.by_kind.items())),
            "statuses": dict(sorted(self.statuses.items())),
            "failures": self.failures,
        }


class DirectFuzz:
    """A server's answers to cases, judged into `report`."""

    def __init__(self, url: str, process: subprocess.Popen[bytes]) -> None:
        import httpx

        self.process = process
        self.report = DirectFuzzReport()
        self._kind = ""
        self._transport_error: type[Exception] = httpx.TransportError
        self.http = {
            who: httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
            for who, key in KEYS.items()
        }
        self.store = httpx.Client(timeout=60)

    def close(self) -> None:
        for client in self.http.values():
            client.close()
        self.store.close()

    # calls

    def post(self, who: str, path: str, json: Any) -> Any:
        """The answer, or None for a dropped connection."""
        try:
            headers = {"Content-Type": "application/json"}
            if isinstance(json, Raw):
                body = json.text.encode("utf-8", "surrogatepass")
            else:  # as ASCII JSON: a lone surrogate a case made goes as its escape
                body = dumps(json).encode()
            return self.http[who].post(path, content=body, headers=headers)
        except self._transport_error:
            return None

    def store_put(self, url: str, headers: dict[str, str], blob: bytes) -> int | None:
        try:
            return int(self.store.put(url, content=blob, headers=headers).status_code)
        except self._transport_error:
            return None

    def alive(self) -> bool:
        if self.process.poll() is not None:
            return False
        try:
            return bool(self.http["admin"].get("/healthz", timeout=10).status_code == 200)
        except self._transport_error:
            return False

    def counts(self) -> dict[str, int]:
        counts = {}
        for ns in SPECS:
            r = self.http["admin"].get(f"/v1/namespaces/{ns}")
            if r.status_code != 200:
                raise Setup("namespace count", r.status_code, r.text)
            counts[ns] = int(r.json()["trajectories"])
        return counts

    def read(self, namespace: str, ids: list[str]) -> dict[str, npt.NDArray[Any]]:
        """The top-k routes `[T, L, K]` of those of `ids` that are readable."""
        ids = [i for i in dict.fromkeys(ids) if _valid_id(i)]
        if not ids:
            return {}
        r = self.http["admin"].post(
            f"/v1/namespaces/{namespace}/routes/batch", json={"ids": ids, "include_stale": True}
        )
        if r.status_code != 200:
            raise Setup("read", r.status_code, r.text)
        batch = decode_batch(r.content)[1]
        return {
            tid: item.routes.to_topk()
            for tid, item in zip(ids, batch.items, strict=True)
            if item is not None and item.routes is not None
        }

    # judging

    def bad_put(self, ctx: Ctx, status: int) -> None:
        self.report.bad_acks += 1
        self.report.fail(f"{self._kind} #{ctx.serial}: a second PUT to a plan's URL got {status}")

    def final(
        self,
        ctx: Ctx,
        namespace: str,
        body: Any,
        expect: str,
        who: str,
        writes: list[TrajectoryWrite],
        ids: list[str],
        oracle: list[tuple[str, npt.NDArray[Any]]] | None,
    ) -> None:
        rep, kind = self.report, f"{self._kind} #{ctx.serial}"
        before = self.counts()
        r = self.post(who, f"/v1/namespaces/{namespace}/writes/commit", body)
        if r is None:
            rep.server_errors += 1
            rep.statuses["dropped"] += 1
            rep.fail(f"{kind}: the connection dropped")
            return
        rep.statuses[f"{r.status_code}"] += 1
        if r.status_code >= 500:
            rep.server_errors += 1
            rep.fail(f"{kind}: {r.status_code} {r.text[:300]}")
            return
        rows = len(body.get("segments") or ()) if isinstance(body, dict) else 0
        rows = rows if isinstance(body, dict) and isinstance(body.get("segments"), list) else 1
        if expect == "accept":
            self._control(kind, r, namespace, writes)
            return
        if r.status_code < 400:
            if expect == "either" and oracle is not None:
                got = self.read(namespace, [tid for tid, _ in oracle])
                if all(tid in got and np.array_equal(got[tid], want) for tid, want in oracle):
                    rep.by_kind["either: taken, read back as its spans hold"] += 1
                    return
            rep.bad_acks += max(rows, 1)
            rep.fail(f"{kind}: acknowledged {r.status_code} {r.text[:300]}")
            return
        if not _clear(r):
            rep.server_errors += 1
            rep.fail(f"{kind}: an unclear {r.status_code}: {r.text[:300]}")
            return
        after = self.counts()
        readable = self.read(namespace, ids) if namespace in SPECS else {}
        if after != before or readable:
            rep.bad_acks += max(len(readable), 1)
            rep.fail(f"{kind}: refused {r.status_code} yet changed {before} -> {after}")
            return
        rep.rejected += 1

    def _control(self, kind: str, r: Any, namespace: str, writes: list[TrajectoryWrite]) -> None:
        """A valid commit: accepted, and every write read back as written."""
        rep = self.report
        rep.controls += 1
        if r.status_code != 200:
            rep.fail(f"{kind}: a valid commit got {r.status_code} {r.text[:300]}")
            return
        got = self.read(namespace, [w.trajectory_id for w in writes])
        spec = SPECS[namespace]
        for w in writes:
            want = Engine.prepare_routes(spec, w).to_topk()
            if w.trajectory_id not in got or not np.array_equal(got[w.trajectory_id], want):
                rep.fail(f"{kind}: {w.trajectory_id} not read back as written")
                return
        rep.controls_ok += 1

    def case(self, kind: str, serial: int, rng: random.Random) -> None:
        self._kind = kind
        self.report.cases += 1
        self.report.by_kind[kind] += 1
        try:
            CASES[kind][1](Ctx(self, serial, rng))
        except Setup as exc:
            if exc.status is None or exc.status >= 500:
                self.report.server_errors += 1
            self.report.setup_failures += 1
            self.report.fail(f"{kind} #{serial}: setup: {exc}")


def _clear(r: Any) -> bool:
    """A refusal that says what was wrong: a message and a code other than internal."""
    try:
        error = r.json()["error"]
        return bool(error["message"]) and error["code"] not in ("", "internal")
    except (ValueError, KeyError, TypeError):
        return False


def _valid_id(value: object) -> bool:
    try:
        check_id(value)  # type: ignore[arg-type]
    except R3StoreError:
        return False
    return True


def campaign(fuzz: DirectFuzz, cases: int, seed: int) -> DirectFuzzReport:
    """`cases` cases drawn by weight (every kind at least once when `cases` allows)."""
    rng = random.Random(seed)
    kinds = list(CASES)
    weights = [CASES[k][0] for k in kinds]
    order = kinds[:cases] + rng.choices(kinds, weights, k=max(0, cases - len(kinds)))
    for serial, kind in enumerate(order):
        fuzz.case(kind, serial, random.Random(rng.getrandbits(64)))
        if not fuzz.alive():
            fuzz.report.deaths += 1
            fuzz.report.fail(f"{kind} #{serial}: the server died")
            break
    return fuzz.report


def check_indexes(fuzz: DirectFuzz, store: ObjectStore) -> None:
    """Every row a blob's index names is one a rebuild would serve (`read_blob`): it
    must be one the server acknowledged, readable now."""
    named: dict[str, set[str]] = {}
    for info in store.list(INDEX_PREFIX):
        body = json.loads(store.get(info.key))
        named.setdefault(body["namespace"], set()).update(r["trajectory_id"] for r in body["rows"])
    for ns, ids in sorted(named.items()):
        readable = fuzz.read(ns, sorted(ids))
        stray = sorted(ids - set(readable))
        if stray:
            fuzz.report.bad_acks += len(stray)
            fuzz.report.fail(f"indexes of {ns} name rows never acknowledged: {stray[:5]}")


def start(seaweed: SeaweedFS, directory: Path) -> tuple[subprocess.Popen[bytes], str, str]:
    """A server on SeaweedFS (a fresh prefix, returned) with namespaces "fa" and "fb"."""
    keys = [{"name": who, "role": ROLES[who], "key": key} for who, key in KEYS.items()]
    env = {"R3STORE_API_KEYS": json.dumps(keys), **seaweed.server_env()}
    return (*start_server(directory, env), env["R3STORE_S3__PREFIX"])


def run(seaweed: SeaweedFS, cases: int, seed: int = 1) -> DirectFuzzReport:
    """A campaign of `cases` cases against a fresh server on `seaweed`."""
    with tempfile.TemporaryDirectory(prefix="r3store-direct-fuzz-") as directory:
        process, url, prefix = start(seaweed, Path(directory))
        fuzz = DirectFuzz(url, process)
        store = seaweed.new_store(prefix)
        try:
            for ns, spec in SPECS.items():
                r = fuzz.http["admin"].post(
                    "/v1/namespaces", json={"name": ns, "spec": json.loads(spec.to_json())}
                )
                if r.status_code != 201:
                    raise RuntimeError(f"cannot create namespace {ns}: {r.status_code} {r.text}")
            report = campaign(fuzz, cases, seed)
            if fuzz.alive():
                check_indexes(fuzz, store)
            return report
        finally:
            store.close()
            fuzz.close()
            stop_server(process)
