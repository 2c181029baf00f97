"""The client's uploads (`WriteCalls`, mixed into `Calls`): each write's slot order and
array shape are checked against the namespace's spec (`check_write`) and the routes are
validated and encoded here, as the engine would, before anything is sent; then they go
straight to the object store where the server allows it (`direct_writes`), else through
the server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import numpy as np

from r3store.errors import InvalidRoutes, R3StoreError
from r3store.logic.codec import Dictionary
from r3store.logic.streams import fits
from r3store.logic.writes import check_slot_order, encode_write
from r3store.protocol.models import PutItem
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import PutResult, TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client.direct_writes import DirectWrites
from r3store_client.namespace_calls import NamespaceCalls
from r3store_client.put_lanes import CARRY_BYTES, Carried, Lead, Waiting, encoded_size
from r3store_client.steps import Call, Work


def check_shape(write: TrajectoryWrite, spec: RouteSpec) -> None:
    """Refuse routes whose array is not `[num_tokens - 1 or num_tokens, layers, width]`
    (`InvalidRoutes` naming the expected and the given shape). Only the bytes travel, so
    a transposed `[layers, num_tokens - 1, top_k]` array of the same size would be read
    as other routes."""
    if write.encoded is not None or (write.topk is None and write.mask is None):
        return  # encoded streams are checked by decoding; none at all: `check` says so
    n = write.num_tokens
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        return  # `check` names a bad token count
    routes = write.topk if write.topk is not None else write.mask
    kind, width, name = (
        ("top-k ids", spec.top_k, "top_k")
        if write.topk is not None
        else ("masks", spec.mask_bytes, "ceil(num_experts / 8)")
    )
    given = tuple(int(d) for d in np.shape(routes))
    if len(given) == 3 and given[0] in (n - 1, n) and given[1:] == (spec.num_layers, width):
        return
    raise InvalidRoutes(
        f"{write.trajectory_id}: {kind} of shape {list(given)}; expected "
        f"[{n - 1}, {spec.num_layers}, {width}] ([num_tokens - 1, layers, {name}]; "
        f"{n} rows also accepted) for {n} tokens"
    )


def check_write(write: TrajectoryWrite, spec: RouteSpec) -> None:
    """What a write states checked against the namespace's spec before it is sent, in
    every upload: its slot order (`check_slot_order`: routes whose producer promises no
    order refused by an ordered namespace; the statement is not sent, so the server
    cannot make this check) and its array's shape (`check_shape`)."""
    check_slot_order(write, spec)
    check_shape(write, spec)


def encoded_writes(
    writes: Sequence[TrajectoryWrite], spec: RouteSpec, dictionary: Dictionary | None = None
) -> list[TrajectoryWrite]:
    """The writes checked against the spec (`check_write`) and their routes validated
    and encoded as the engine would (bad ones raise `InvalidRoutes` before
    anything is sent; with the namespace's `dictionary` for a direct write); a segment
    too long to be checked by decoding stays as ids."""
    for w in writes:
        check_write(w, spec)
    return [encode_write(w, spec, dictionary) if fits(spec, w.num_tokens) else w for w in writes]


def upload_body(
    writes: Sequence[TrajectoryWrite],
    spec: RouteSpec,
    encode: Callable[..., list[TrajectoryWrite]] | None = encoded_writes,
) -> bytes:
    """An upload's body: the writes encoded by `encode` (`encoded_writes`, which checks
    each against the spec, or what reuses a put's encoding; no dictionary: the server
    compresses at rest), or (`encode` None) each checked (`check_write`) and sent as
    ids."""
    if encode is not None:
        return encode_writes(encode(writes, spec, None))
    for w in writes:
        check_write(w, spec)
    return encode_writes(writes)


def _encoded_once(
    digest: bytes | None,
    encoded: list[TrajectoryWrite],
    writes: list[TrajectoryWrite],
    spec: RouteSpec,
    dictionary: Dictionary | None,
) -> list[TrajectoryWrite]:
    """`encoded`, the writes as their puts encoded them with the dictionary `digest`
    names, where the same dictionary is asked for; else encoded again."""
    if (None if dictionary is None else dictionary.digest) == digest:
        return encoded
    return encoded_writes(writes, spec, dictionary)


class WriteCalls(NamespaceCalls, DirectWrites):
    """Uploads, direct or through the server; mixed into `Calls`."""

    def _put(self, namespace: str, writes: Sequence[TrajectoryWrite]) -> Call[list[PutResult]]:
        """Upload trajectories (or appended segments); returns after the durable commit,
        a result per write with its route ref (`PutResult.ref`). Each write's slot order
        and array shape are checked against the namespace's spec (`check_write`), and
        routes are validated and encoded here (unless `encode=False`): bad ones raise
        `InvalidRoutes` before anything is sent. Encoded puts go in the client's lanes
        (`put_lanes`), straight to the object store where the server allows it
        (`direct_writes`; `r3store_client.direct_writes`)."""
        spec = yield from self._spec(namespace)
        if self.encode and all(
            isinstance(w.num_tokens, int) and fits(spec, w.num_tokens) for w in writes
        ):
            for w in writes:
                check_write(w, spec)
            items = yield from self._put_together(namespace, spec, writes)
        else:
            encode = encoded_writes if self.encode else None
            body = yield Work(upload_body, (list(writes), spec, encode))
            items = yield from self._upload(namespace, body)
        results = [item.result() for item in items]
        return [dataclasses.replace(r, ref=RouteRef.of(namespace, r)) for r in results]

    def _put_together(
        self, namespace: str, spec: RouteSpec, writes: Sequence[TrajectoryWrite]
    ) -> Call[list[PutItem]]:
        """An encoded put in one of the client's lanes (`put_lanes`): the writes are
        encoded first (for a direct write, with the dictionary the namespace's last
        write plan named), then wait for a lane; a put that gets one after waiting
        sends the others waiting with it, and hands each its results
        (`r3store_client.put_lanes`)."""
        lanes = self._lanes
        if lanes is None:
            return (yield from self._put_alone(namespace, spec, writes, encoded_writes))
        plan = (yield from self._last_plan(namespace)) if self._chooses_direct() else None
        dictionary, carry = None, CARRY_BYTES
        if plan is not None:
            dictionary = yield Work(self._plan_dictionary, (plan,))
            carry = min(carry, plan.max_bytes // 2)
        encoded = yield Work(encoded_writes, (list(writes), spec, dictionary))
        digest = None if dictionary is None else dictionary.digest
        entry = Waiting(list(writes), encoded, digest, encoded_size(encoded))
        while True:
            turn = yield from lanes.join(namespace, entry, carry)
            if isinstance(turn, Carried):
                return turn.items
            if isinstance(turn, Lead):
                break
            entry = entry.again_alone()  # its carrier failed
        group = turn.group
        reuse = partial(_encoded_once, digest, [w for e in group for w in e.encoded])
        try:
            try:
                items = yield from self._put_alone(
                    namespace, spec, [w for e in group for w in e.writes], reuse
                )
            except R3StoreError:
                if len(group) == 1:
                    raise
                items = None
            mine = lanes.carried(group, items)
            if mine is None:  # the group failed: its own answer, or refusal, in its lane
                own = partial(_encoded_once, digest, encoded)
                mine = yield from self._put_alone(namespace, spec, writes, own)
        finally:
            try:
                lanes.carried(group, None)  # whoever is not answered goes again alone
            finally:
                lanes.release(namespace)
        return mine

    def _put_alone(
        self,
        namespace: str,
        spec: RouteSpec,
        writes: Sequence[TrajectoryWrite],
        encode: Callable[..., list[TrajectoryWrite]],
    ) -> Call[list[PutItem]]:
        """One encoded put (`encode`: `encoded_writes`, or what reuses their encoding):
        direct where the server allows it, else through the server."""
        items = None
        if self._chooses_direct():
            items = yield from self._put_direct(namespace, spec, writes, encode)
        if items is None:
            body = yield Work(upload_body, (list(writes), spec, encode))
            items = yield from self._upload(namespace, body)
        return items

    def _upload(self, namespace: str, body: bytes) -> Call[list[PutItem]]:
        """An upload through the server; its answer's items."""
        answer = yield from self._json(
            "POST",
            f"/v1/namespaces/{namespace}/trajectories",
            content=body,
            headers={"Content-Type": CONTENT_TYPE},
        )
        return [PutItem.model_validate(item) for item in answer["results"]]
