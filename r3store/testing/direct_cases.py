"""Hostile direct writes (`r3store.testing.direct_fuzz`): each case a short sequence of
plan, PUT and commit calls whose last commit is judged. Here: what a case may do, and
the cases about plans, namespaces, writers and uploads; `direct_mutations` the rest.

A case calls `Ctx.final` once, with what it expects of the commit: "reject" (a 4xx that
makes nothing readable), "accept" (acknowledged, and read back equal to `writes`), or
"either" (a commit the server may refuse, or take and serve exactly what its spans hold,
as `oracle` decodes them here). Setup steps that must work (a plan, a PUT, an earlier
valid commit) raise `Setup` when they do not.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import random
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store.errors import R3StoreError
from r3store.logic import codec, streams
from r3store.logic.writes import encode_write
from r3store.protocol.direct import DirectSegment, pack, unpack
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.synthetic import uniform_topk

PLAIN = RouteSpec(num_layers=2, num_experts=16, top_k=2)  # namespace "fa"
ORDERED = RouteSpec(num_layers=2, num_experts=16, top_k=2, ordered=True)  # namespace "fb"
OTHER = RouteSpec(num_layers=3, num_experts=32, top_k=4)  # no namespace: foreign streams
SPECS = {"fa": PLAIN, "fb": ORDERED}


class Setup(Exception):
    """A step the case needs failed (the status, or None for a dropped connection)."""

    def __init__(self, what: str, status: int | None, text: str = "") -> None:
        super().__init__(f"{what}: {status} {text[:200]}")
        self.status = status


@dataclass(frozen=True)
class Raw:
    """A commit body sent as this text, not as JSON of a value."""

    text: str


@dataclass
class Upload:
    namespace: str
    plan: dict[str, Any]
    blob: bytes
    segments: list[DirectSegment]
    writes: list[TrajectoryWrite]

    def body(self, **changes: Any) -> dict[str, Any]:
        segments = [s.model_dump(mode="json", exclude_none=True) for s in self.segments]
        return {"plan": self.plan["plan"], "size": len(self.blob), "segments": segments, **changes}


class Ctx:
    """What a case may do; `final` records its judged commit (driven by the runner)."""

    def __init__(self, fuzz: Any, serial: int, rng: random.Random) -> None:
        self.fuzz = fuzz  # the DirectFuzz running the case
        self.serial = serial
        self.rng = rng
        self.np = np.random.default_rng(rng.getrandbits(32))
        self._ids = 0

    def new_id(self) -> str:
        self._ids += 1
        return f"dz{self.serial}-{self._ids}"

    def writes(
        self, namespace: str = "fa", count: int = 0, spec: RouteSpec | None = None
    ) -> list[TrajectoryWrite]:
        spec = spec or SPECS[namespace]
        made = []
        for _ in range(count or self.rng.randint(1, 3)):
            n = self.rng.randint(1, 40)
            topk = uniform_topk(self.np, n, spec.num_layers, spec.num_experts, spec.top_k)
            tokens = (
                self.np.integers(0, 50_000, n, dtype=np.int32) if self.rng.random() < 0.5 else None
            )
            group = f"g{self.serial}" if self.rng.random() < 0.5 else None
            made.append(
                TrajectoryWrite(self.new_id(), n, topk=topk, token_ids=tokens, group_id=group)
            )
        return made

    def plan(self, namespace: str = "fa", who: str = "w1") -> dict[str, Any]:
        r = self.fuzz.post(who, f"/v1/namespaces/{namespace}/writes", json={})
        if r is None or r.status_code != 201:
            raise Setup("plan", None if r is None else r.status_code, "" if r is None else r.text)
        plan: dict[str, Any] = r.json()
        return plan

    def put(self, namespace: str, plan: dict[str, Any], blob: bytes, who: str = "w1") -> int | None:
        """The plan's URL for the blob's size asked for, and the blob PUT there: the PUT's
        status, or the URL request's when it was refused (None: no answer)."""
        body = {"plan": plan["plan"], "size": len(blob)}
        r = self.fuzz.post(who, f"/v1/namespaces/{namespace}/writes/upload", json=body)
        if r is None or r.status_code != 200:  # no URL: the status of its refusal
            return None if r is None else r.status_code
        status: int | None = self.fuzz.store_put(r.json()["url"], r.json()["headers"], blob)
        return status

    def upload(
        self,
        namespace: str = "fa",
        writes: list[TrajectoryWrite] | None = None,
        who: str = "w1",
        blob: bytes | None = None,
        spec: RouteSpec | None = None,
    ) -> Upload:
        """A plan of `namespace`, the writes packed, and their blob (or `blob`) PUT."""
        writes = writes if writes is not None else self.writes(namespace, spec=spec)
        packed, segments = pack([encode_write(w, spec or SPECS[namespace]) for w in writes])
        plan = self.plan(namespace, who)
        data = packed if blob is None else blob
        status = self.put(namespace, plan, data, who)
        if status not in (200, 201, 204):
            raise Setup("PUT", status)
        return Upload(namespace, plan, data, segments, writes)

    def commit(self, namespace: str, body: Any, who: str = "w1") -> Any:
        """A commit whose answer is not judged (a setup step)."""
        r = self.fuzz.post(who, f"/v1/namespaces/{namespace}/writes/commit", json=body)
        if r is None or r.status_code != 200:
            raise Setup("commit", None if r is None else r.status_code, "" if r is None else r.text)
        return r

    def final(
        self,
        namespace: str,
        body: Any,
        expect: str,
        who: str = "w1",
        writes: list[TrajectoryWrite] | None = None,
        ids: list[str] | None = None,
        oracle: list[tuple[str, npt.NDArray[Any]]] | None = None,
    ) -> None:
        self.fuzz.final(self, namespace, body, expect, who, writes or [], ids or [], oracle)


def oracle(upload: Upload, segments: list[DirectSegment], spec: RouteSpec) -> Any:
    """What a commit of `segments` of the upload's blob holds, decoded here: (id, top-k)
    each, or None where the streams do not check."""
    try:
        out = []
        if len({(s.trajectory_id, s.source, s.start) for s in segments}) != len(segments):
            return None
        for w in unpack(upload.blob, segments, spec):
            w.check()
            if w.start or w.encoded is None:
                return None
            got, _load = streams.accept(w.encoded, spec, w.num_tokens, b"", None, w.trajectory_id)
            out.append((w.trajectory_id, codec.decode(got, spec, w.num_tokens).to_topk()))
        return out
    except (R3StoreError, ValueError):
        return None


def either(ctx: Ctx, up: Upload, segments: list[DirectSegment]) -> None:
    body = up.body(segments=[s.model_dump(mode="json", exclude_none=True) for s in segments])
    held = oracle(up, segments, SPECS[up.namespace])
    ids = [s.trajectory_id for s in segments]
    ctx.final(up.namespace, body, "reject" if held is None else "either", ids=ids, oracle=held)


def reject(ctx: Ctx, up: Upload, body: Any, namespace: str | None = None, who: str = "w1") -> None:
    ctx.final(
        namespace or up.namespace, body, "reject", who, ids=[w.trajectory_id for w in up.writes]
    )


def pick_ns(ctx: Ctx) -> str:
    return ctx.rng.choice(("fa", "fb"))


# the cases


def control(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    ctx.final(up.namespace, up.body(), "accept", writes=up.writes)


def control_resent(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    ctx.commit(up.namespace, up.body())
    ctx.final(up.namespace, up.body(), "accept", writes=up.writes)


def control_append(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    first = ctx.upload(ns, ctx.writes(ns, 1))
    ctx.commit(ns, first.body())
    w = first.writes[0]
    more = ctx.writes(ns, 1)[0]
    tail = replace(more, trajectory_id=w.trajectory_id, start=w.num_tokens, group_id=None)
    up = ctx.upload(ns, [tail])
    whole = replace(w, num_tokens=w.num_tokens + tail.num_tokens, token_ids=None)
    assert w.topk is not None
    assert tail.topk is not None
    whole = replace(whole, topk=np.concatenate([w.topk, tail.topk]))
    ctx.final(ns, up.body(), "accept", writes=[whole])


def _forge(token: str, how: str, rng: random.Random) -> str:
    payload, mac = token.split(".")
    if how == "random":
        chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.=+/é\x00"
        return "".join(rng.choice(chars) for _ in range(rng.randint(1, 120)))
    if how == "mac":
        raw = bytearray(base64.urlsafe_b64decode(mac + "=" * (-len(mac) % 4)))
        raw[rng.randrange(len(raw))] ^= 1 << rng.randrange(8)
        return f"{payload}.{base64.urlsafe_b64encode(bytes(raw)).rstrip(b'=').decode()}"
    if how == "payload":
        fields = json.loads(base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)))
        fields[rng.choice(("n", "w", "k"))] = rng.choice(("fb", "w2", None, "shards/fa/x.blob"))
        text = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
        return f"{base64.urlsafe_b64encode(text).rstrip(b'=').decode()}.{mac}"
    if how == "resigned":
        signed = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4))
        sig = hmac.new(os.urandom(32), signed, hashlib.sha256).digest()
        return f"{payload}.{base64.urlsafe_b64encode(sig).rstrip(b'=').decode()}"
    cut = rng.randint(0, len(token) - 1)  # truncated (or a dot doubled)
    return token[:cut] if rng.random() < 0.8 else token.replace(".", "..")


def forged_plan(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    how = ctx.rng.choice(("random", "mac", "payload", "resigned", "truncated"))
    forged = _forge(up.plan["plan"], how, ctx.rng) or "x"
    reject(ctx, up, up.body(plan=forged))


def plan_other_namespace(ctx: Ctx) -> None:
    """A blob planned (and uploaded) in one namespace, committed to the other."""
    up = ctx.upload("fa")
    if ctx.rng.random() < 0.5:  # the other namespace has a plan of its own, uploaded
        ctx.upload("fb", blob=up.blob)
    reject(ctx, up, up.body(), namespace="fb")


def object_other_namespace(ctx: Ctx) -> None:
    """The other namespace's plan, naming a blob uploaded with this one's."""
    up = ctx.upload("fa")
    other = ctx.plan("fb")
    reject(ctx, up, up.body(plan=other["plan"]), namespace=ctx.rng.choice(("fa", "fb")))


def unknown_namespace(ctx: Ctx) -> None:
    up = ctx.upload("fa")
    reject(ctx, up, up.body(), namespace=ctx.rng.choice(("nope", "fa-gone", "..", "a" * 200)))


def other_writer(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx), who=ctx.rng.choice(("w1", "admin")))
    reject(ctx, up, up.body(), who="w2")


def never_uploaded(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    writes = ctx.writes(ns)
    _blob, segments = pack([encode_write(w, SPECS[ns]) for w in writes])
    up = Upload(ns, ctx.plan(ns), _blob, segments, writes)
    reject(ctx, up, up.body())


def truncated_blob(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    writes = ctx.writes(ns)
    blob, _segments = pack([encode_write(w, SPECS[ns]) for w in writes])
    cut = blob[: ctx.rng.randint(1, len(blob) - 1)]
    up = ctx.upload(ns, writes, blob=cut)
    size = ctx.rng.choice((len(cut), len(blob)))
    reject(ctx, up, up.body(size=size))


def wrong_size(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    n = len(up.blob)
    size = ctx.rng.choice((n - 1, n + 1, 1, 2 * n, 256 << 20, (256 << 20) + 1, 2**40))
    reject(ctx, up, up.body(size=max(1, size)))
