"""The routes of a multi-turn rollout, kept turn by turn (numpy only; the agent loop that
uses it is `r3store_client.verl_turns`).

An engine answers each turn's generate call with routes over the conversation it was
sent and what it generated (`[P + G - 1, L, K]`: no row for the last token, which no
forward pass saw), rows of tokens it did not compute (a prefix-cache hit) left zero.
An agent loop that keeps only the last turn's answer (verl's `ToolAgentLoop`) loses
the routes earlier turns' tokens were generated with: the last turn's rows for them
are a prefill's choice, or zero. `Turns` keeps each turn's own rows instead: the rows
held from earlier turns stay, and a turn adds the rows from where they end, which it
computed (a prefix cache holds only tokens an earlier turn computed). It refuses a
conversation whose earlier tokens changed between turns (a loop that rewrote its
history): its routes cannot be joined exactly.

`TurnsMeta` is what travels with the sample (`TURNS_FIELD` of its extra fields): where
each turn's rows start and the policy version each was generated with, so that the
store keeps each turn as a segment of its own (`TurnsMeta.segments`).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from r3store.errors import InvalidInput

TURNS_FIELD = "r3store_turns"  # the key of a sample's extra fields that holds its turns


@dataclass(frozen=True)
class TurnsMeta:
    """Where each turn's rows start (the first at 0, increasing) and the policy version
    each turn was generated with (None: not known)."""

    starts: tuple[int, ...]
    policy_versions: tuple[int | None, ...]

    def __post_init__(self) -> None:
        starts = self.starts
        if (
            not starts
            or starts[0] != 0
            or len(self.policy_versions) != len(starts)
            or any(not isinstance(s, int) or isinstance(s, bool) for s in starts)
            or any(b <= a for a, b in itertools.pairwise(starts))
            or any(
                v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0)
                for v in self.policy_versions
            )
        ):
            raise InvalidInput(
                f"{TURNS_FIELD}: turns must start at 0 and go forward, each with a policy "
                f"version or none, got {list(starts)[:8]} and {list(self.policy_versions)[:8]}"
            )

    def to_json(self) -> dict[str, Any]:
        return {"starts": list(self.starts), "policy_versions": list(self.policy_versions)}

    @classmethod
    def of(cls, extra_fields: object) -> TurnsMeta | None:
        """The turns a sample's extra fields name, or None when they name none;
        `InvalidInput` when what they name is not turns."""
        if not isinstance(extra_fields, dict) or extra_fields.get(TURNS_FIELD) is None:
            return None
        value = extra_fields[TURNS_FIELD]
        if not isinstance(value, dict):
            raise InvalidInput(f"{TURNS_FIELD} must be an object, got {type(value).__name__}")
        starts, versions = value.get("starts"), value.get("policy_versions")
        if not isinstance(starts, list | tuple) or not isinstance(versions, list | tuple):
            raise InvalidInput(f"{TURNS_FIELD} needs lists 'starts' and 'policy_versions'")
        return cls(tuple(starts), tuple(versions))

    def segments(self, num_tokens: int) -> list[tuple[int, int, int | None]]:
        """`(start, num_tokens, policy_version)` of each turn's segment of a sample of
        `num_tokens` tokens: a turn ends where the next one starts, the last at the end;
        turns past the end (cut off by the agent loop) are left out."""
        pairs = zip(self.starts, self.policy_versions, strict=True)
        kept = [(s, v) for s, v in pairs if s < num_tokens]
        ends = [s for s, _ in kept[1:]] + [num_tokens]
        return [(s, end - s, v) for (s, v), end in zip(kept, ends, strict=True)]


@dataclass
class Turns:
    """The routes of one conversation, turn by turn (`add` each generate call's answer)."""

    rows: np.ndarray | None = None  # [held, L, K]: every turn's own rows, joined
    tokens: list[int] = field(default_factory=list)  # the conversation so far
    starts: list[int] = field(default_factory=list)
    policy_versions: list[int | None] = field(default_factory=list)

    def add(
        self,
        prompt_ids: Sequence[int],
        token_ids: Sequence[int],
        routes: Any,
        policy_version: int | None = None,
    ) -> np.ndarray:
        """The routes of the conversation with this turn's: `routes` is the engine's
        answer to `prompt_ids` (which must go on from the conversation so far), having
        generated `token_ids`. Returns `[len(prompt_ids) + len(token_ids) - 1, L, K]`:
        the rows earlier turns computed, then this turn's."""
        routes = np.asarray(routes)
        covered = len(prompt_ids) + len(token_ids) - 1
        if routes.ndim != 3 or routes.shape[0] != covered:
            raise InvalidInput(
                f"a turn's routes must be [prompt + generated - 1, L, K] = [{covered}, L, K], "
                f"got {list(routes.shape)}"
            )
        held = 0 if self.rows is None else len(self.rows)
        if list(prompt_ids[: len(self.tokens)]) != self.tokens:
            raise InvalidInput(
                "this turn's prompt does not go on from the conversation the earlier turns "
                "were generated in (its history was rewritten): their routes cannot be joined"
            )
        if self.rows is not None and routes.shape[1:] != self.rows.shape[1:]:
            raise InvalidInput(
                f"a turn's routes of layers and top-k {list(routes.shape[1:])}, the earlier "
                f"turns' {list(self.rows.shape[1:])}"
            )
        fresh = routes[held:covered]
        self.rows = fresh.copy() if self.rows is None else np.concatenate([self.rows, fresh])
        if len(fresh):
            self.starts.append(held)
            self.policy_versions.append(policy_version)
        self.tokens = [*prompt_ids, *token_ids]
        return self.rows

    def meta(self) -> TurnsMeta | None:
        """Where each turn's rows start, and their policy versions (None before a turn)."""
        if not self.starts:
            return None
        return TurnsMeta(tuple(self.starts), tuple(self.policy_versions))
