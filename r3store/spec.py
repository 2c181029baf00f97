"""The route spec: the shape of one namespace's routing decisions."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

from r3store.errors import InvalidInput, InvalidSpec

MAX_EXPERTS = 65535
MAX_TOP_K = 64
MAX_LAYERS = 4096


@dataclass(frozen=True)
class RouteSpec:
    """What a namespace's routes look like.

    `RouteSpec(num_layers=48, num_experts=128, top_k=8)` describes Qwen3-30B-A3B.
    `ordered=True` keeps each token-layer's top-k slots in the order written: the
    producer's rank order, or slots a write keeps verbatim; a write whose producer
    promises no order (vLLM's, SGLang's: `TrajectoryWrite.slot_order`) is refused.
    Otherwise routes are sets and come back sorted by expert id. `allow_fewer=True`
    accepts token-layers with fewer than `top_k` experts (capacity drops).
    """

    num_layers: int
    num_experts: int
    top_k: int
    ordered: bool = False
    allow_fewer: bool = False
    model: str = ""

    def __post_init__(self) -> None:
        for name, value, high in (
            ("num_layers", self.num_layers, MAX_LAYERS),
            ("num_experts", self.num_experts, MAX_EXPERTS),
            ("top_k", self.top_k, MAX_TOP_K),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= high:
                raise InvalidSpec(f"{name} must be an integer in [1, {high}], got {value!r}")
        if self.top_k > self.num_experts:
            raise InvalidSpec(f"top_k ({self.top_k}) exceeds num_experts ({self.num_experts})")
        if len(self.model) > 200:
            raise InvalidSpec("model name is longer than 200 characters")

    @property
    def id_dtype(self) -> np.dtype[Any]:
        """The smallest unsigned dtype that holds every expert id."""
        return np.dtype(np.uint8) if self.num_experts <= 256 else np.dtype(np.uint16)

    @property
    def mask_bytes(self) -> int:
        """Bytes of one token-layer's bit-packed mask: ceil(E / 8)."""
        return (self.num_experts + 7) // 8

    def narrowed(self, num_layers: int) -> RouteSpec:
        """The spec of a read of `num_layers` of these layers (`layers` in a read)."""
        return replace(self, num_layers=num_layers)

    def check_layers(self, layers: Sequence[int]) -> tuple[int, ...]:
        """Layers asked of a read: distinct indices into these layers, increasing."""
        chosen = tuple(layers)
        if (
            not chosen
            or any(isinstance(x, bool) or not isinstance(x, int) for x in chosen)
            or list(chosen) != sorted(set(chosen))
            or chosen[0] < 0
            or chosen[-1] >= self.num_layers
        ):
            raise InvalidInput(
                f"layers must be distinct increasing indices in [0, {self.num_layers}), "
                f"got {list(chosen)[:8]}"
            )
        return chosen

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> RouteSpec:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError) as exc:
            raise InvalidSpec(f"cannot parse route spec: {exc}") from exc
