"""Hostile direct writes that lie in their blob or their commit's body: streams
swapped, spans that do not fit, bytes that are not what they say, zstd frames that
declare another size, metadata of any kind (`r3store.testing.direct_fuzz`); and `CASES`,
every kind of case with its weight.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np
import zstandard

from r3store.logic.writes import encode_write
from r3store.protocol.direct import pack
from r3store.testing.direct_cases import (
    OTHER,
    SPECS,
    Ctx,
    Raw,
    control,
    control_append,
    control_resent,
    either,
    forged_plan,
    never_uploaded,
    object_other_namespace,
    other_writer,
    pick_ns,
    plan_other_namespace,
    reject,
    truncated_blob,
    unknown_namespace,
    wrong_size,
)


def swapped_streams(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    a, b = ctx.writes(ns, 2)
    if a.num_tokens == b.num_tokens:
        assert b.topk is not None
        longer = np.concatenate([b.topk, b.topk[:1]])
        b = replace(b, num_tokens=b.num_tokens + 1, topk=longer, token_ids=None)
    up = ctx.upload(ns, [a, b])
    s, t = up.segments
    field = ctx.rng.choice(("route_ids", "token_ids", "route_order", "all"))
    if field == "all" or getattr(s, field) is None or getattr(t, field) is None:
        field = "route_ids"
    swapped = [
        s.model_copy(update={field: getattr(t, field)}),
        t.model_copy(update={field: getattr(s, field)}),
    ]
    either(ctx, up, swapped)


def _span_case(ctx: Ctx, how: str) -> None:
    up = ctx.upload(pick_ns(ctx))
    segments = list(up.segments)
    i = ctx.rng.randrange(len(segments))
    s = segments[i]
    names = [f for f in ("route_ids", "route_counts", "route_order", "token_ids") if getattr(s, f)]
    name = ctx.rng.choice(names)
    span = getattr(s, name)
    n = len(up.blob)
    if how == "past_end":
        span = span.model_copy(
            update={"offset": ctx.rng.choice((n, n - span.length + 1, 2**40, 2**62))}
        )
    elif how == "overlap":  # into the next stream, or starting inside its own
        grow = ctx.rng.randint(1, 16)
        span = span.model_copy(
            update={"length": span.length + grow}
            if ctx.rng.random() < 0.5
            else {"offset": span.offset + 1}
        )
    elif how == "zero":
        span = span.model_copy(update={"length": 0, "offset": ctx.rng.choice((0, span.offset, n))})
    else:  # shared: another segment's streams named twice
        j = ctx.rng.randrange(len(segments))
        span = getattr(segments[j], name) or span
    segments[i] = s.model_copy(update={name: span})
    either(ctx, up, segments)


def span_past_end(ctx: Ctx) -> None:
    _span_case(ctx, "past_end")


def span_overlap(ctx: Ctx) -> None:
    _span_case(ctx, "overlap")


def span_zero(ctx: Ctx) -> None:
    _span_case(ctx, "zero")


def span_shared(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    up = ctx.upload(ns, ctx.writes(ns, 2))
    a, b = up.segments
    same = b.model_copy(
        update={
            k: getattr(a, k)
            for k in ("num_tokens", "route_ids", "route_counts", "route_order", "token_ids")
        }
    )
    either(ctx, up, [a, same])


def random_streams(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    writes = ctx.writes(ns)
    _blob, segments = pack([encode_write(w, SPECS[ns]) for w in writes])
    junk = (
        os.urandom(ctx.rng.randint(1, 4096))
        if ctx.rng.random() < 0.5
        else _blob[:4] + os.urandom(len(_blob))
    )
    up = ctx.upload(ns, writes, blob=junk)
    spans = []
    for s in segments:
        update = {}
        for name in ("route_ids", "route_counts", "route_order", "token_ids"):
            if getattr(s, name) is not None:
                start = ctx.rng.randrange(len(junk))
                update[name] = getattr(s, name).model_copy(
                    update={"offset": start, "length": ctx.rng.randint(0, len(junk) - start)}
                )
        spans.append(s.model_copy(update=update))
    either(ctx, up, spans)


def _fcs(frame: bytes, value: int) -> bytes:
    """The frame with its content size field set to `value` where that fits its width."""
    fhd = frame[4]
    single, flag, dict_flag = (fhd >> 5) & 1, fhd >> 6, fhd & 3
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dict_flag]
    width = (1 if single else 0, 2, 4, 8)[flag]
    if width == 0:
        return frame
    stored = value - 256 if width == 2 else value
    if not 0 <= stored < 1 << (8 * width):
        return frame
    return frame[:at] + stored.to_bytes(width, "little") + frame[at + width :]


def zstd_wrong_size(ctx: Ctx) -> None:
    """One stream replaced by a zstd frame that declares (or holds) another size."""
    ns = pick_ns(ctx)
    spec = SPECS[ns]
    writes = ctx.writes(ns, 1)
    w = writes[0]
    real = w.num_tokens * spec.num_layers * spec.top_k
    how = ctx.rng.choice(("short", "long", "lies", "no_size", "trailing", "two_frames"))
    plain = zstandard.ZstdCompressor()
    if how == "short":
        frame = plain.compress(bytes(real - 1) if real > 1 else b"")
    elif how == "long":
        frame = plain.compress(bytes(real + ctx.rng.choice((1, 7, 1 << 20))))
    elif how == "lies":  # declares the right size, holds more
        frame = _fcs(plain.compress(bytes(range(256)) * (real // 256 + 1)), real)
    elif how == "no_size":
        frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(real))
    elif how == "trailing":
        frame = plain.compress(bytes(real)) + b"\0\1\2"
    else:
        frame = plain.compress(bytes(real)) + plain.compress(bytes(real))
    packed, segments = pack([encode_write(w, spec)])
    blob = packed + frame
    up = ctx.upload(ns, writes, blob=blob)
    name = ctx.rng.choice(("route_ids", "token_ids"))
    span = segments[0].route_ids.model_copy(update={"offset": len(packed), "length": len(frame)})
    either(ctx, up, [segments[0].model_copy(update={name: span})])


def blob_flip(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    writes = ctx.writes(ns)
    raw = bytearray(pack([encode_write(w, SPECS[ns]) for w in writes])[0])
    for _ in range(ctx.rng.randint(1, 3)):
        raw[ctx.rng.randrange(len(raw))] ^= 1 << ctx.rng.randrange(8)
    up = ctx.upload(ns, writes, blob=bytes(raw))
    either(ctx, up, up.segments)


def transform_flip(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    segments = [
        s.model_copy(
            update={"route_transform": 1 - s.route_transform if s.route_transform < 2 else 0}
        )
        for s in up.segments
    ]
    either(ctx, up, segments)


def other_spec(ctx: Ctx) -> None:
    ns = pick_ns(ctx)
    up = ctx.upload(ns, ctx.writes(ns, spec=OTHER), spec=OTHER)
    reject(ctx, up, up.body())


def duplicate_segments(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    body = up.body()
    body["segments"] = body["segments"] + [copy.deepcopy(ctx.rng.choice(body["segments"]))]
    reject(ctx, up, body)


def huge_num_tokens(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    body = up.body()
    seg = ctx.rng.choice(body["segments"])
    seg["num_tokens"] = ctx.rng.choice(
        (2**31 - 1, 2**31, 2**30, 2**24, seg["num_tokens"] + 1, 2**63, 10**30)
    )
    reject(ctx, up, body)


def recommit_other(ctx: Ctx) -> None:
    """A committed plan sent again naming other trajectories in the same blob."""
    up = ctx.upload(pick_ns(ctx))
    ctx.commit(up.namespace, up.body())
    body = up.body()
    renamed = [ctx.new_id() for _ in body["segments"]]
    for seg, name in zip(body["segments"], renamed, strict=True):
        seg["trajectory_id"] = name
    ctx.final(up.namespace, body, "reject", ids=renamed)


def overwrite_after_commit(ctx: Ctx) -> None:
    """The plan used again once committed: no new URL is given for it, and the one
    given before is create-only, so readers keep the bytes."""
    up = ctx.upload(pick_ns(ctx))
    ctx.commit(up.namespace, up.body())
    status = ctx.put(up.namespace, up.plan, os.urandom(len(up.blob)))
    if status is not None and status < 300:
        ctx.fuzz.bad_put(ctx, status)
    ctx.final(up.namespace, up.body(), "accept", writes=up.writes)


BAD_VALUES: dict[str, tuple[Any, ...]] = {
    "trajectory_id": ("", "x" * 300, "a\x00b", "a\x85b", "\ud800", 5, None, ["a"]),
    "num_tokens": (0, -1, "4", 4.5, True, None, 2**64),
    "start": (-1, "0", 1.5, 7, 2**31),
    "prompt_len": (-1, 10**6, "0", 2**31),
    "policy_version": (-1, "1", 2**63, 1.0),
    "group_id": ("", "g\x07", 3, "y" * 300),
    "source": ("bogus", 1, None, ""),
    "route_transform": (-1, 7, 256, "0", None, 0.0),
    "route_ids": (
        None,
        "x",
        {"offset": -1, "length": 5},
        {"offset": "0", "length": 5},
        {"offset": 0},
        {"offset": 0, "length": -3},
        {"offset": 2**80, "length": 1},
        [0, 5],
        {"offset": 0, "length": 1, "x": 1},
    ),
    "token_ids": ({"offset": 0, "length": 2**70}, {"offset": 1.5, "length": 2}),
    "extra": (1,),
}
BAD_TOP: dict[str, tuple[Any, ...]] = {
    "size": (0, -1, "10", None, 2**40, 1.0, True),
    "plan": ("", 5, "x" * 5000, None, "a.b"),
    "segments": ([], {}, "x", [1], [None], None, [{}] * 5000),
    "extra": (1,),
}
RAW = (
    "",
    "not json",
    "[]",
    "null",
    '{"plan":',
    '{"plan": "a", "size": 1, "segments": [{"a": 1e999}]}',
)


def bad_metadata(ctx: Ctx) -> None:
    up = ctx.upload(pick_ns(ctx))
    body: Any = up.body()
    roll = ctx.rng.random()
    if roll < 0.6:
        seg = ctx.rng.choice(body["segments"])
        name = ctx.rng.choice(sorted(BAD_VALUES))
        seg[name] = copy.deepcopy(ctx.rng.choice(BAD_VALUES[name]))
    elif roll < 0.9:
        name = ctx.rng.choice(sorted(BAD_TOP))
        body[name] = copy.deepcopy(ctx.rng.choice(BAD_TOP[name]))
    else:
        body = Raw(ctx.rng.choice(RAW))
    reject(ctx, up, body)


CASES: dict[str, tuple[float, Callable[[Ctx], None]]] = {
    "control": (6, control),
    "control_resent": (1, control_resent),
    "control_append": (1, control_append),
    "forged_plan": (4, forged_plan),
    "plan_other_namespace": (1.5, plan_other_namespace),
    "object_other_namespace": (1.5, object_other_namespace),
    "unknown_namespace": (0.5, unknown_namespace),
    "other_writer": (1.5, other_writer),
    "never_uploaded": (1.5, never_uploaded),
    "truncated_blob": (2, truncated_blob),
    "wrong_size": (2, wrong_size),
    "swapped_streams": (2, swapped_streams),
    "span_past_end": (2, span_past_end),
    "span_overlap": (2, span_overlap),
    "span_zero": (1.5, span_zero),
    "span_shared": (1, span_shared),
    "random_streams": (2, random_streams),
    "zstd_wrong_size": (3, zstd_wrong_size),
    "blob_flip": (2, blob_flip),
    "transform_flip": (1, transform_flip),
    "other_spec": (1, other_spec),
    "duplicate_segments": (1.5, duplicate_segments),
    "huge_num_tokens": (2, huge_num_tokens),
    "recommit_other": (1.5, recommit_other),
    "overwrite_after_commit": (1, overwrite_after_commit),
    "bad_metadata": (6, bad_metadata),
}
