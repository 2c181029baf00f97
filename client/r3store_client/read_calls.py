"""The client's reads of routes (`ReadCalls`, mixed into `Calls`): batches by id
(optionally of some `layers`), the stored token ids, route refs resolved, sampling;
through the server, or with `direct` from the object store (`direct_reads`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt

from r3store.errors import InvalidInput, NotFound, RefMismatch
from r3store.logic.codec import decode_tokens
from r3store.logic.sampling import Strategy
from r3store.policy import Source
from r3store.protocol.wire import ReadFormat, decode_batch
from r3store.records import Batch
from r3store.refs import RouteRef, by_source, resolve
from r3store.spec import RouteSpec
from r3store_client.direct_reads import DirectReads
from r3store_client.steps import Call, Work


def token_ids_of(batch: Batch) -> dict[str, npt.NDArray[np.int32] | None]:
    out: dict[str, npt.NDArray[np.int32] | None] = {}
    for item in batch.found:
        parts = [
            None
            if s.encoded is None or s.encoded.tokens is None
            else decode_tokens(s.encoded.tokens, s.num_tokens)
            for s in item.segments
        ]
        out[item.trajectory_id] = (
            None
            if all(p is None for p in parts)
            else np.concatenate(
                [
                    np.full(s.num_tokens, -1, np.int32) if p is None else p
                    for s, p in zip(item.segments, parts, strict=True)
                ]
            )
        )
    return out


class ReadCalls(DirectReads):
    """Reads of routes, through the server or the object store; mixed into `Calls`."""

    def _get_batch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Call[Batch]:
        """Routes of `ids` in the order asked; `missing` and `stale` name the others.
        `decode=False` keeps the stored streams (`tensors.compact` decodes them).
        Each trajectory comes from one route source (`TrajectoryRead.source`): `source`
        if given, else the first of the namespace's `read_sources` it holds. `layers`
        (distinct increasing indices): only those layers' routes travel and are
        returned (`Batch.layers`), for a pipeline stage's routers."""
        answer = yield from self._fetch(namespace, ids, include_stale, fmt, decode, source, layers)
        return answer[1]

    def _fetch(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        fmt: ReadFormat = ReadFormat.ENCODED,
        decode: bool = True,
        source: Source | None = None,
        layers: Sequence[int] | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """Like `get_batch`, with the route spec of the answer (the namespace's, its
        `num_layers` those asked when `layers` is given)."""
        body: dict[str, Any] = {
            "ids": list(ids),
            "include_stale": include_stale,
            "format": str(fmt),
            "source": source,
        }
        if layers is not None:
            body["layers"] = list(layers)
        path = f"/v1/namespaces/{namespace}/routes/batch"
        response = yield from self._request("POST", path, json=body)
        answer: tuple[RouteSpec, Batch] = yield Work(
            decode_batch, (response.content, decode, self.decoders)
        )
        return answer

    def _token_ids(
        self,
        namespace: str,
        ids: Sequence[str],
        include_stale: bool = False,
        source: Source | None = None,
    ) -> Call[dict[str, npt.NDArray[np.int32] | None]]:
        """The token ids stored with `ids`, by id (`[num_tokens]` int32, -1 where a
        segment came without them; None for a trajectory stored without any); missing
        and stale ids are left out. Only the token streams are decoded, not the routes;
        the routes' stored streams still travel with them (the read endpoint has no
        tokens-only form)."""
        _spec, batch = yield from self._fetch(
            namespace, ids, include_stale, decode=False, source=source
        )
        out: dict[str, npt.NDArray[np.int32] | None] = yield Work(token_ids_of, (batch,))
        return out

    def _resolve(
        self,
        refs: Sequence[RouteRef],
        include_stale: bool = False,
        direct: bool = False,
        layers: Sequence[int] | None = None,
    ) -> Call[tuple[RouteSpec, Batch]]:
        """The routes `refs` name (of one namespace), in their order, each trajectory
        only the segments its ref names, as stored streams (`tensors.compact` decodes
        them). Only these trajectories are read, and with `layers` only those layers
        (a pipeline stage's; `MegatronReplay.needed_layers`); `direct`: from the object
        store, as `fetch_direct` (whole segments: not with `layers`, refused before any
        round trip). A ref whose trajectory is gone or stale (its namespace deleted
        included), or stored with other content or at another policy version than the
        ref says, raises `RefMismatch` naming it."""
        namespace, wanted = by_source(refs)
        if direct and layers is not None:
            raise InvalidInput(
                "a direct read fetches whole stored segments: select layers through the "
                "server (direct=False)"
            )
        reads: dict[Source, Batch] = {}
        try:
            for source, ids in wanted.items():
                if direct:
                    spec, reads[source] = yield from self._fetch_direct(
                        namespace, ids, include_stale, source
                    )
                else:
                    spec, reads[source] = yield from self._fetch(
                        namespace, ids, include_stale, decode=False, source=source, layers=layers
                    )
        except NotFound as exc:  # the namespace: gone, and every trajectory in it
            raise RefMismatch(
                f"{refs[0]}: the trajectory is no longer stored (its namespace: {exc})"
            ) from exc
        return spec, resolve(refs, reads)

    def _sample(
        self,
        namespace: str,
        n: int,
        strategy: Strategy = Strategy.FIFO,
        whole_groups: bool = False,
        seed: int | None = None,
    ) -> Call[Batch]:
        """Take up to `n` trajectories; each counts toward the namespace's sampling cap.

        Not retried after the server may have acted on it (a retry would count twice):
        a `StoreError` here means the outcome is unknown.
        """
        body = {"n": n, "strategy": str(strategy), "whole_groups": whole_groups, "seed": seed}
        path = f"/v1/namespaces/{namespace}/routes/sample"
        response = yield from self._request("POST", path, json=body, idempotent=False)
        answer: tuple[RouteSpec, Batch] = yield Work(
            decode_batch, (response.content, True, self.decoders)
        )
        return answer[1]
