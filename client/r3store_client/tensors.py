"""Routes as torch tensors, in the layouts trainers use (torch required).

- `padded`: ids `[B, T, L, K]` with a validity mask of the same shape. Padding and
  unrecorded token-layers hold *distinct* dummy ids, never repeated zeros, so
  expert-parallel all-to-all split sizes stay sane; `valid` says which slots are real.
- `dense_masks`: `[B, T, L, E]` bool.
- `packed`: `[total_tokens, L, K]` for sequence packing, with `cu_seqlens`.

Ids are int32: the smallest dtype torch indexes with (gather, index_select, scatter).
Host tensors can be pinned (`pin=True`) for `.to(device, non_blocking=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from r3store.records import Batch, TrajectoryRead
from r3store.routes import Routes
from r3store.spec import RouteSpec


@dataclass
class RouteTensors:
    """A micro-batch's routes. `ids`/`valid` are `[B, T, L, K]` (or `[N, L, K]` packed),
    `lengths` `[B]` tokens per trajectory, `cu_seqlens` `[B + 1]` for packed layouts."""

    ids: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    def _map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> RouteTensors:
        cu = None if self.cu_seqlens is None else fn(self.cu_seqlens)
        return RouteTensors(fn(self.ids), fn(self.valid), fn(self.lengths), cu)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> RouteTensors:
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> RouteTensors:
        """Page-locked copies for asynchronous copies to the GPU (as is without CUDA)."""
        if not torch.cuda.is_available():
            return self
        return self._map(lambda t: t.pin_memory())

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(ids, valid)` of one MoE layer: `[..., K]` each."""
        return self.ids[..., index, :], self.valid[..., index, :]


def _reads(batch: Batch) -> list[TrajectoryRead]:
    missing = [tid for tid, item in zip(batch.ids, batch.items, strict=True) if item is None]
    if missing:
        raise KeyError(f"no routes for {missing[:5]} (missing or stale)")
    return [item for item in batch.items if item is not None]


def _filled(routes: Routes, spec: RouteSpec) -> tuple[np.ndarray, np.ndarray]:
    """Token-major ids `[T, L, K]` int32 with distinct dummies in empty slots, and validity."""
    ids = np.ascontiguousarray(routes.ids, dtype=np.int32)
    k = spec.top_k
    if routes.layer_counts is None:
        return ids, np.ones(ids.shape, dtype=bool)
    valid = np.ascontiguousarray(routes.slot_valid().transpose(1, 0, 2))
    rows = np.flatnonzero(~valid.reshape(-1, k).all(axis=1))
    flat_ids, flat_valid = ids.reshape(-1, k), valid.reshape(-1, k)
    for row in rows:  # rare: unrecorded or partial token-layers
        used = set(flat_ids[row][flat_valid[row]].tolist())
        spare = [e for e in range(spec.num_experts) if e not in used][: k - len(used)]
        flat_ids[row][~flat_valid[row]] = spare
    return ids, valid


def padded(
    batch: Batch, spec: RouteSpec, pad_to: int | None = None, pin: bool = False
) -> RouteTensors:
    """`[B, T, L, K]` ids, padded to the longest trajectory (or `pad_to`)."""
    reads = _reads(batch)
    length = max([r.num_tokens for r in reads] + [pad_to or 0])
    shape = (len(reads), length, spec.num_layers, spec.top_k)
    dummy = np.broadcast_to(np.arange(spec.top_k, dtype=np.int32), shape)
    ids, valid = np.array(dummy), np.zeros(shape, dtype=bool)
    for b, read in enumerate(reads):
        assert read.routes is not None
        i, v = _filled(read.routes, spec)
        ids[b, : read.num_tokens], valid[b, : read.num_tokens] = i, v
    out = RouteTensors(
        torch.from_numpy(ids),
        torch.from_numpy(valid),
        torch.tensor([r.num_tokens for r in reads], dtype=torch.int32),
    )
    return out.pin_memory() if pin else out


def packed(batch: Batch, spec: RouteSpec, pin: bool = False) -> RouteTensors:
    """`[total_tokens, L, K]` ids of the trajectories back to back, with `cu_seqlens`."""
    reads = _reads(batch)
    parts = [_filled(r.routes, spec) for r in reads if r.routes is not None]
    lengths = torch.tensor([r.num_tokens for r in reads], dtype=torch.int32)
    cu = torch.zeros(len(reads) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    out = RouteTensors(
        torch.from_numpy(np.concatenate([p[0] for p in parts])),
        torch.from_numpy(np.concatenate([p[1] for p in parts])),
        lengths,
        cu,
    )
    return out.pin_memory() if pin else out


def dense_masks(batch: Batch, spec: RouteSpec, pad_to: int | None = None) -> torch.Tensor:
    """`[B, T, L, E]` bool: which experts each token-layer chose (False past the end)."""
    routes = padded(batch, spec, pad_to)
    out = torch.zeros((*routes.ids.shape[:3], spec.num_experts), dtype=torch.bool)
    out.scatter_(-1, routes.ids.long(), routes.valid)
    return out


def rank_slice(items: Sequence[str], rank: int, world_size: int) -> list[str]:
    """This data-parallel rank's share of a global batch: contiguous and balanced
    (sizes differ by at most one), so no rank needs the others' routes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    per, extra = divmod(len(items), world_size)
    start = rank * per + min(rank, extra)
    return list(items[start : start + per + (1 if rank < extra else 0)])


def micro_batches(items: Sequence[str], size: int) -> list[list[str]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
