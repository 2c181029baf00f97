"""Routes as torch tensors, in the layouts trainers use (torch required).

- `compact`: what travels from host to device: `CompactRoutes`, ids in the narrowest
  dtype (uint8 up to 256 experts, else int16 or int32) and chosen-slot counts (uint8),
  decoded in parallel threads straight into preallocated (optionally pinned) buffers,
  layer-major (`[B, L, T, K]` storage, seen as `[B, T, L, K]`) or token-major. 1 byte
  per slot instead of 5; `.to(device).widen()` makes the int32 ids and the validity
  mask on the device, where that costs nearly nothing.
- `padded`: ids `[B, T, L, K]` with a validity mask of the same shape. Padding and
  unrecorded token-layers hold *distinct* dummy ids, never repeated zeros, so
  expert-parallel all-to-all split sizes stay sane; `valid` says which slots are real.
- `dense_masks`: `[B, T, L, E]` bool.
- `packed`: `[total_tokens, L, K]` for sequence packing, with `cu_seqlens`.

Wide ids are int32: the smallest dtype torch indexes with (gather, index_select,
scatter). Host tensors can be pinned (`pin=True`) for `.to(device, non_blocking=True)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Literal

import numpy as np

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store import codec
from r3store.records import Batch, TrajectoryRead
from r3store.routes import Routes
from r3store.spec import RouteSpec

Layout = Literal["padded", "packed"]
Major = Literal["layer", "token"]


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


@dataclass
class CompactRoutes:
    """A micro-batch's routes as they travel: `ids` `[B, T, L, K]` (or `[N, L, K]`
    packed) in the narrowest dtype, `counts` `[B, T, L]` (or `[N, L]`) uint8 chosen
    slots (0: no route, and padding). Move it, then `widen()` where it will be used."""

    ids: torch.Tensor
    counts: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor | None = None

    def to(self, device: torch.device | str, non_blocking: bool = True) -> CompactRoutes:
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, non_blocking=non_blocking)

        cu = None if self.cu_seqlens is None else move(self.cu_seqlens)
        return CompactRoutes(move(self.ids), move(self.counts), move(self.lengths), cu)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.ids, self.counts))

    def widen(self) -> RouteTensors:
        """int32 ids and the validity mask, on the tensors' own device; empty slots get
        distinct dummies as `padded` gives them."""
        k = self.ids.shape[-1]
        slots = torch.arange(k, device=self.ids.device, dtype=torch.int32)
        valid = slots.to(self.counts.dtype) < self.counts.unsqueeze(-1)
        ids = torch.where(valid, self.ids.to(torch.int32), slots)
        partial = (self.counts > 0) & (self.counts < k)
        if bool(partial.any()):  # rare: fewer than K chosen; dummies must avoid them
            where = partial.nonzero(as_tuple=True)
            rows, ok = ids[where].cpu(), valid[where].cpu()
            for row, row_ok in zip(rows, ok, strict=True):
                used = set(row[row_ok].tolist())
                spare = [e for e in range(2 * k + len(used)) if e not in used]
                row[~row_ok] = torch.tensor(spare[: int((~row_ok).sum())], dtype=torch.int32)
            ids[where] = rows.to(ids.device)
        return RouteTensors(ids, valid, self.lengths, self.cu_seqlens)


def as_wide(routes: RouteTensors | CompactRoutes) -> RouteTensors:
    """Routes as the replay paths use them (compact ones widened where they are)."""
    return routes.widen() if isinstance(routes, CompactRoutes) else routes


def compact_dtype(spec: RouteSpec) -> torch.dtype:
    if spec.num_experts <= 256:
        return torch.uint8
    return torch.int16 if spec.num_experts <= 2**15 else torch.int32


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


def compact(
    batch: Batch,
    spec: RouteSpec,
    layout: Layout = "padded",
    major: Major = "layer",
    pad_to: int | None = None,
    pin: bool = False,
    executor: Executor | None = None,
) -> CompactRoutes:
    """The batch's routes as `CompactRoutes`: each trajectory's segments decoded (from
    their stored streams, or taken as decoded) straight into their place in buffers
    allocated once, in parallel on `executor`."""
    reads = _reads(batch)
    lengths = [r.num_tokens for r in reads]
    layers, k = spec.num_layers, spec.top_k
    offsets = [0] * len(reads)
    if layout == "padded":
        rows, width = len(reads), max([*lengths, pad_to or 0])
    else:
        rows, width = 1, sum(lengths)
        offsets = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(int).tolist()
    inner = (layers, width) if major == "layer" else (width, layers)
    ids = _buffer((rows, *inner, k), compact_dtype(spec), pin)
    counts = _buffer((rows, *inner), torch.uint8, pin)
    ids_np, counts_np = ids.numpy(), counts.numpy()

    def place(b: int) -> None:
        read, row = reads[b], (b if layout == "padded" else 0)
        for begin, routes in _segment_routes(read, spec):
            n = routes.layers.shape[1]
            at = slice(offsets[b] + begin, offsets[b] + begin + n)
            source, count = routes.layers, routes.layer_counts
            if major == "layer":
                np.copyto(ids_np[row, :, at], source, casting="unsafe")
                counts_np[row, :, at] = k if count is None else count
            else:
                np.copyto(ids_np[row, at], source.transpose(1, 0, 2), casting="unsafe")
                counts_np[row, at] = k if count is None else count.T

    if executor is not None and len(reads) > 1:
        list(executor.map(place, range(len(reads))))
    else:
        for b in range(len(reads)):
            place(b)
    seen_ids = ids.permute(0, 2, 1, 3) if major == "layer" else ids
    seen_counts = counts.permute(0, 2, 1) if major == "layer" else counts
    sizes = torch.tensor(lengths, dtype=torch.int32)
    if layout == "packed":
        cu = torch.zeros(len(reads) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(sizes, 0)
        return CompactRoutes(seen_ids[0], seen_counts[0], sizes, cu)
    return CompactRoutes(seen_ids, seen_counts, sizes)


def _segment_routes(read: TrajectoryRead, spec: RouteSpec) -> list[tuple[int, Routes]]:
    """`(first token, routes)` of each segment: decoded here from stored streams, or the
    routes the read already holds (all segments joined)."""
    if read.routes is not None:
        return [(0, read.routes)]
    out = []
    for segment in read.segments:
        if segment.encoded is None:
            raise ValueError(f"{read.trajectory_id}: a read with neither routes nor streams")
        out.append((segment.start, codec.decode(segment.encoded, spec, segment.num_tokens)))
    return out


def _reads(batch: Batch) -> list[TrajectoryRead]:
    missing = [tid for tid, item in zip(batch.ids, batch.items, strict=True) if item is None]
    if missing:
        raise KeyError(f"no routes for {missing[:5]} (missing or stale)")
    return [item for item in batch.items if item is not None]


def padded(
    batch: Batch, spec: RouteSpec, pad_to: int | None = None, pin: bool = False
) -> RouteTensors:
    """`[B, T, L, K]` int32 ids and validity, padded to the longest trajectory (or
    `pad_to`), on the host."""
    out = compact(batch, spec, "padded", pad_to=pad_to).widen()
    return out.pin_memory() if pin else out


def packed(batch: Batch, spec: RouteSpec, pin: bool = False) -> RouteTensors:
    """`[total_tokens, L, K]` ids of the trajectories back to back, with `cu_seqlens`."""
    out = compact(batch, spec, "packed").widen()
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
