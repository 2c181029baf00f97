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

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

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


def _fill(routes: Routes, spec: RouteSpec, ids: np.ndarray, valid: np.ndarray) -> None:
    """Write one trajectory's routes into token-major `ids`/`valid` `[T, L, K]` views.

    Token-layers with no route get the dummies 0..K-1 (distinct within a row); partial
    rows, whose zeros could repeat a chosen expert, get spare experts instead.
    """
    ids[...] = routes.layers.transpose(1, 0, 2)
    if routes.layer_counts is None:
        valid[...] = True
        return
    k = spec.top_k
    counts = routes.layer_counts.T
    np.less(np.arange(k, dtype=np.uint8), counts[..., None], out=valid)
    ids[counts == 0] = np.arange(k, dtype=np.int32)
    partial = np.argwhere((counts > 0) & (counts < k))
    for t, layer in partial:  # rare: fewer than K experts chosen
        row, ok = ids[t, layer], valid[t, layer]
        used = set(row[ok].tolist())
        row[~ok] = [e for e in range(spec.num_experts) if e not in used][: k - len(used)]


def padded(
    batch: Batch, spec: RouteSpec, pad_to: int | None = None, pin: bool = False
) -> RouteTensors:
    """`[B, T, L, K]` ids, padded to the longest trajectory (or `pad_to`)."""
    reads = _reads(batch)
    length = max([r.num_tokens for r in reads] + [pad_to or 0])
    shape = (len(reads), length, spec.num_layers, spec.top_k)
    ids = np.empty(shape, dtype=np.int32)
    valid = np.empty(shape, dtype=bool)
    for b, read in enumerate(reads):
        assert read.routes is not None
        n = read.num_tokens
        _fill(read.routes, spec, ids[b, :n], valid[b, :n])
        ids[b, n:] = np.arange(spec.top_k, dtype=np.int32)  # padding: distinct dummies
        valid[b, n:] = False
    out = RouteTensors(
        torch.from_numpy(ids),
        torch.from_numpy(valid),
        torch.tensor([r.num_tokens for r in reads], dtype=torch.int32),
    )
    return out.pin_memory() if pin else out


def packed(batch: Batch, spec: RouteSpec, pin: bool = False) -> RouteTensors:
    """`[total_tokens, L, K]` ids of the trajectories back to back, with `cu_seqlens`."""
    reads = _reads(batch)
    lengths = torch.tensor([r.num_tokens for r in reads], dtype=torch.int32)
    cu = torch.zeros(len(reads) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lengths, 0)
    shape = (int(cu[-1]), spec.num_layers, spec.top_k)
    ids = np.empty(shape, dtype=np.int32)
    valid = np.empty(shape, dtype=bool)
    for b, read in enumerate(reads):
        assert read.routes is not None
        start, end = int(cu[b]), int(cu[b + 1])
        _fill(read.routes, spec, ids[start:end], valid[start:end])
    out = RouteTensors(torch.from_numpy(ids), torch.from_numpy(valid), lengths, cu)
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
