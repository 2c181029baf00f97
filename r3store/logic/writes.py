"""A write's routes made ready where they are: validated into canonical form, and
encoded as the engine would encode them, so a rollout worker's CPU does it instead of
the server's. The engine's put and the client's uploads both go through here. Pure.

    check_slot_order(write, spec)               # InvalidRoutes: no order for an ordered spec
    routes = canonical_routes(write, spec)      # InvalidRoutes naming the first offence
    encoded = encode_write(write, spec)         # the same write, its routes as streams
"""

from __future__ import annotations

from dataclasses import replace

from r3store.errors import InvalidInput, InvalidRoutes
from r3store.logic import codec, streams
from r3store.logic.routes import from_mask, from_topk
from r3store.records import SET, TrajectoryWrite
from r3store.route_types import Dictionary, Routes, SentStreams
from r3store.spec import RouteSpec
from r3store.transforms import WITH_DICTIONARY


def check_slot_order(write: TrajectoryWrite, spec: RouteSpec) -> None:
    """Refuse a write whose slots are a set (`slot_order="set"`: its producer promises
    no order) for a namespace that keeps the slot order (`ordered`, K > 1): it would
    store an order that means nothing, and give it back as if it did."""
    if write.slot_order == SET and spec.ordered and spec.top_k > 1:
        producer = write.producer or "its producer"
        raise InvalidRoutes(
            f"{write.trajectory_id}: {producer} promises no order of the top-{spec.top_k} "
            "slots, and the namespace keeps that order (ordered=True): store these routes "
            "in a namespace with ordered=False (the same experts, sorted by id), or state "
            "slot_order='verbatim' to keep the slots as given, knowing they are no rank order"
        )


def canonical_routes(write: TrajectoryWrite, spec: RouteSpec) -> Routes:
    """The routes of `write` validated against `spec`, in canonical form: ids or masks
    converted (`InvalidRoutes` naming the trajectory and the first offending position),
    streams a client encoded checked by decoding them (`streams.accept`); a write whose
    slots are a set refused for an ordered spec (`check_slot_order`)."""
    check_slot_order(write, spec)
    if write.encoded is not None:
        where = write.trajectory_id
        stored, _load = streams.accept(write.encoded, spec, write.num_tokens, b"", None, where)
        return codec.decode(stored, spec, write.num_tokens)
    try:
        if write.topk is not None:
            return from_topk(write.topk, spec, write.num_tokens)
        if write.mask is not None:
            return from_mask(write.mask, spec, write.num_tokens)
    except InvalidInput as exc:
        raise type(exc)(f"{write.trajectory_id}: {exc}") from None
    raise InvalidInput(f"{write.trajectory_id}: give exactly one of topk, mask or encoded")


def encode_write(
    write: TrajectoryWrite, spec: RouteSpec, dictionary: Dictionary | None = None
) -> TrajectoryWrite:
    """`write` checked, with its routes validated and encoded here as the engine would
    (the server checks them by decoding); a write already encoded as it is. With the
    namespace's `dictionary` (a direct write), the ids are compressed with it in
    `WITH_DICTIONARY`'s transforms: about the bytes they take at rest."""
    write.check()
    if write.encoded is not None:
        return write
    transforms = None if dictionary is None else WITH_DICTIONARY
    encoded = codec.encode(  # the digest is the server's to compute
        canonical_routes(write, spec),
        spec,
        digest=False,
        dictionary=dictionary,
        transforms=transforms,
    )
    return replace(write, topk=None, mask=None, encoded=SentStreams.of(encoded))
