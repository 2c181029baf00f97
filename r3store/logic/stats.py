"""Route statistics: expert load, agreement between two sources' routes, drift between
policy versions. Pure numpy over canonical routes; no I/O.

- Load: how many token-layers chose each expert, `[L, E]`. A token-layer with no
  recorded route counts for no expert.
- Agreement of routes `a` and `b` for the same tokens, per layer: the chosen experts
  both hold, over the experts the smaller choice holds, summed over the token-layers
  both recorded: `sum |A & B| / sum min(|A|, |B|)`. For full top-k choices that is the
  mean fraction of the k experts the two share.
- Drift of a layer from one policy version to the next: the Jensen-Shannon divergence
  (base 2, in [0, 1]) of the two expert-load distributions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import zstandard

from r3store.errors import InvalidInput
from r3store.route_types import Routes
from r3store.spec import RouteSpec

Counts = npt.NDArray[np.int64]
_CHUNK = 1 << 22  # slot pairs compared at once


def _valid(
    layer_counts: npt.NDArray[np.uint8] | None, shape: tuple[int, ...]
) -> npt.NDArray[np.bool_]:
    """`[L, T, K]`: which slots hold a chosen expert."""
    if layer_counts is None:
        return np.ones(shape, bool)
    return np.arange(shape[2], dtype=np.uint8) < layer_counts[:, :, None]


def expert_load(routes: Routes, spec: RouteSpec) -> Counts:
    """`[L, E]` int64: token-layers that chose each expert, per layer."""
    layers = routes.layers
    num_layers, num_tokens, k = layers.shape
    out = np.empty((num_layers, spec.num_experts), np.int64)
    for layer in range(num_layers):
        out[layer] = np.bincount(layers[layer].reshape(-1), minlength=spec.num_experts)
    if routes.layer_counts is not None:  # canonical empty slots hold expert 0: take them off
        held = routes.layer_counts.sum(axis=1, dtype=np.int64)
        out[:, 0] -= num_tokens * k - held
    return out


@dataclass(frozen=True)
class Overlap:
    """Per layer: experts both sources chose, and the experts of the smaller choice."""

    matches: Counts  # [L]
    slots: Counts  # [L]

    def __add__(self, other: Overlap) -> Overlap:
        return Overlap(self.matches + other.matches, self.slots + other.slots)

    @property
    def overall(self) -> float | None:
        """Agreement over all layers together."""
        slots = int(self.slots.sum())
        return None if slots == 0 else int(self.matches.sum()) / slots

    @property
    def fraction(self) -> list[float | None]:
        """Agreement per layer (None where no token-layer was recorded by both)."""
        return [
            None if s == 0 else float(m) / float(s)
            for m, s in zip(self.matches, self.slots, strict=True)
        ]


def overlap(a: Routes, b: Routes) -> Overlap:
    """How far the routes `a` and `b` of the same tokens agree, per layer."""
    if a.layers.shape != b.layers.shape:
        raise InvalidInput(f"routes of shapes {a.layers.shape} and {b.layers.shape} differ")
    va = _valid(a.layer_counts, a.layers.shape)
    vb = _valid(b.layer_counts, b.layers.shape)
    num_layers, num_tokens, k = a.layers.shape
    total = Overlap(np.zeros(num_layers, np.int64), np.zeros(num_layers, np.int64))
    step = max(1, _CHUNK // max(1, num_layers * k * k))
    for begin in range(0, num_tokens, step):
        part = slice(begin, begin + step)
        ia, ib, ma, mb = a.layers[:, part], b.layers[:, part], va[:, part], vb[:, part]
        same = (ia[..., :, None] == ib[..., None, :]) & ma[..., :, None] & mb[..., None, :]
        held = np.minimum(ma.sum(axis=2), mb.sum(axis=2))
        # chosen ids are distinct within a token-layer: each pair that matches is one
        total += Overlap(same.sum(axis=(1, 2, 3), dtype=np.int64), held.sum(axis=1, dtype=np.int64))
    return total


def drift(before: Counts, after: Counts) -> list[float | None]:
    """Jensen-Shannon divergence (base 2) per layer of two `[L, E]` loads (None for a
    layer either load left empty)."""
    out: list[float | None] = []
    for p_counts, q_counts in zip(before, after, strict=True):
        p_total, q_total = int(p_counts.sum()), int(q_counts.sum())
        if p_total == 0 or q_total == 0:
            out.append(None)
            continue
        p, q = p_counts / p_total, q_counts / q_total
        m = (p + q) / 2

        def kl(x: npt.NDArray[np.float64], m: npt.NDArray[np.float64] = m) -> float:
            held = x > 0
            return float(np.sum(x[held] * np.log2(x[held] / m[held])))

        out.append(max(0.0, min(1.0, (kl(p) + kl(q)) / 2)))
    return out


def imbalance(load: Counts) -> list[float | None]:
    """Per layer: the busiest expert's load over the mean load (1.0: even)."""
    out: list[float | None] = []
    for row in load:
        total = int(row.sum())
        out.append(None if total == 0 else float(row.max()) * row.size / total)
    return out


def pack(values: Counts) -> bytes:
    """Counts as the catalog keeps them: int64 little-endian, zstd."""
    return zstandard.ZstdCompressor(level=3).compress(values.astype("<i8").tobytes())


def unpack(blob: bytes, shape: tuple[int, ...]) -> Counts:
    size = int(np.prod(shape)) * 8
    raw = zstandard.ZstdDecompressor().decompress(blob, max_output_size=size)
    if len(raw) != size:
        raise InvalidInput(f"stored counts hold {len(raw)} bytes, not {size}")
    return np.frombuffer(raw, "<i8").astype(np.int64).reshape(shape)
