"""Choosing trajectories for buffer-style sampling: FIFO or uniform, optionally by group."""

from __future__ import annotations

import random
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from r3store.errors import InvalidInput


class Strategy(StrEnum):
    FIFO = "fifo"  # oldest committed first
    UNIFORM = "uniform"  # uniformly at random


@dataclass(frozen=True)
class Candidate:
    trajectory_id: str
    group_id: str | None
    created_at: float


def choose(
    candidates: Sequence[Candidate],
    n: int,
    strategy: Strategy,
    whole_groups: bool = False,
    rng: random.Random | None = None,
) -> list[str]:
    """Up to `n` trajectory ids from `candidates`, never more.

    With `whole_groups`, groups are chosen (by their oldest member for FIFO) and taken
    whole, so a prompt group is never split: groups are added while they fit in `n`.
    A group larger than `n` is never taken (it would have to be split, or the answer
    be larger than asked); when every group is, `InvalidInput` says how large the
    smallest one is. Trajectories without a group count as groups of one.
    """
    if n <= 0 or not candidates:
        return []
    rng = rng or random.Random()
    ordered = sorted(candidates, key=lambda c: (c.created_at, c.trajectory_id))
    if not whole_groups:
        if strategy is Strategy.FIFO:
            return [c.trajectory_id for c in ordered[:n]]
        return [c.trajectory_id for c in rng.sample(ordered, min(n, len(ordered)))]
    groups: dict[str, list[str]] = defaultdict(list)
    for c in ordered:
        groups[c.group_id if c.group_id is not None else f"\0{c.trajectory_id}"].append(
            c.trajectory_id
        )
    keys = [key for key, members in groups.items() if len(members) <= n]  # oldest first
    if not keys:
        smallest = min(len(members) for members in groups.values())
        raise InvalidInput(
            f"every prompt group to sample holds more than n={n} trajectories (the smallest "
            f"{smallest}), and with whole_groups an answer holds whole groups and at most "
            "n trajectories: ask for a larger n, or sample without whole_groups"
        )
    if strategy is Strategy.UNIFORM:
        rng.shuffle(keys)
    chosen: list[str] = []
    for key in keys:
        if len(chosen) + len(groups[key]) > n:
            break
        chosen.extend(groups[key])
        if len(chosen) >= n:
            break
    return chosen
