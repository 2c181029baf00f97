"""Route sources of one trajectory: the rules for writing and serving them. Pure.

The `engine` segments are the trajectory: its tokens, group, prompt length and policy
versions. A segment of another source (`predicted`, `trainer`) annotates the engine
segment of the same start and length, and takes its metadata. A read serves one
source whole: the first of the wanted sources whose segments cover exactly the engine
segments; routes of two sources are never mixed in one answer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Protocol, TypeVar

from r3store.errors import InvalidInput
from r3store.policy import ENGINE, Source
from r3store.records import Segment, TrajectoryWrite


class _Stored(Protocol):
    @property
    def source(self) -> Source: ...
    @property
    def start(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...


_S = TypeVar("_S", bound=_Stored)


EngineSegments = dict[tuple[str, int], Segment]  # per (trajectory id, start)


def engine_segments(
    stored: dict[tuple[str, Source], list[Segment]], batch: Sequence[TrajectoryWrite]
) -> EngineSegments:
    """The engine segment of each trajectory and start, stored or in the same put (a
    stored one first), made once per put: `inherit` looks each write's up in it."""
    found: EngineSegments = {}
    for (tid, source), segments in stored.items():
        if source == ENGINE:
            for s in segments:
                found.setdefault((tid, s.start), s)
    for w in batch:
        if w.source == ENGINE:
            key = (w.trajectory_id, w.start)
            if key not in found:
                found[key] = Segment(
                    w.start, w.num_tokens, b"", w.group_id, w.prompt_len, w.policy_version
                )
    return found


def inherit(write: TrajectoryWrite, engines: EngineSegments) -> TrajectoryWrite:
    """`write` with the metadata it takes from its trajectory (`engines`, from
    `engine_segments`): an appended engine segment takes the group and prompt length; a
    segment of another source takes those and the policy version of the engine segment
    it annotates. Raises `InvalidInput` when there is nothing to take them from, or the
    write states other values."""
    tid = write.trajectory_id
    if write.source == ENGINE and write.start == 0:
        return write
    first = engines.get((tid, 0))
    if write.source == ENGINE:
        if first is None:
            raise InvalidInput(
                f"{tid}: cannot append from token {write.start} to a trajectory that is not stored"
            )
        if write.group_id is not None and write.group_id != first.group_id:
            raise InvalidInput(f"{tid}: an appended segment changes the group id")
        if write.prompt_len not in (0, first.prompt_len):
            raise InvalidInput(f"{tid}: an appended segment changes prompt_len")
        return dataclasses.replace(write, group_id=first.group_id, prompt_len=first.prompt_len)
    where = f"{tid} ({write.source} routes from token {write.start})"
    base = engines.get((tid, write.start))
    if first is None or base is None or base.num_tokens != write.num_tokens:
        raise InvalidInput(
            f"{where}: no engine segment of {write.num_tokens} tokens starts there; "
            "routes of another source annotate stored engine routes of the same tokens"
        )
    group, prompt = first.group_id, first.prompt_len
    if write.group_id is not None and write.group_id != group:
        raise InvalidInput(f"{where}: group id {write.group_id!r}, not the trajectory's {group!r}")
    if write.prompt_len not in (0, prompt):
        raise InvalidInput(f"{where}: prompt_len {write.prompt_len}, not the trajectory's {prompt}")
    if write.policy_version not in (0, base.policy_version):
        raise InvalidInput(
            f"{where}: policy version {write.policy_version}, not the engine segment's "
            f"{base.policy_version}"
        )
    return dataclasses.replace(
        write, group_id=group, prompt_len=prompt, policy_version=base.policy_version
    )


def choose_source(
    segments: Sequence[_S], wanted: Sequence[Source]
) -> tuple[Source, list[_S]] | None:
    """The source to serve of one trajectory's segments (all sources, in start order)
    and its segments: the first of `wanted` that covers the engine segments exactly.
    None when none does, or the trajectory has no engine segments."""
    engine = [s for s in segments if s.source == ENGINE]
    if not engine:
        return None
    shape = [(s.start, s.num_tokens) for s in engine]
    for source in wanted:
        held = [s for s in segments if s.source == source]
        if [(s.start, s.num_tokens) for s in held] == shape:
            return source, held
    return None
