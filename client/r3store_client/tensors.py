"""Routes as torch tensors, in the layouts trainers use (torch required).

- `compact`: what travels from host to device: `CompactRoutes`, ids in the narrowest
  dtype (uint8 up to 256 experts, else int16 or int32; or one the caller gives that
  holds every id) and chosen-slot counts (uint8),
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

Routes read from r3store carry the token ids stored with them (`tokens`, -1 where none
were stored) and their `Origin` (namespace, trajectory ids), so that the replay paths
can check, on the device, that the batch they replay into holds the very tokens the
routes were recorded for (`token_check.TokenCheck`) and name the trajectory when it
does not.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

import numpy as np

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidInput
from r3store.logic import codec
from r3store.logic.routes import Routes, row_words
from r3store.records import Batch, TrajectoryRead
from r3store.spec import RouteSpec

T = TypeVar("T")
Layout = Literal["padded", "packed"]
Major = Literal["layer", "token"]


@dataclass(frozen=True)
class Origin:
    """Where a micro-batch's routes come from: their namespace, the trajectory of each
    sequence (batch order), the trajectories stored without token ids for some or all
    of their tokens (those tokens cannot be checked), and the namespace's layers the
    routes' layer axis holds (None: all of them; a read of some `layers`)."""

    namespace: str | None = None
    trajectory_ids: tuple[str, ...] = ()
    untokened: tuple[str, ...] = ()
    layers: tuple[int, ...] | None = None

    def sequence(self, b: int) -> str:
        """Sequence `b` of the micro-batch, named by its trajectory when known."""
        if b < len(self.trajectory_ids):
            return f"trajectory {self.trajectory_ids[b]!r} (sequence {b} of the micro-batch)"
        return f"sequence {b} of the micro-batch"

    @property
    def where(self) -> str:
        return f"namespace {self.namespace!r}" if self.namespace else "routes of no namespace"


@dataclass
class RouteTensors:
    """A micro-batch's routes. `ids`/`valid` are `[B, T, L, K]` (or `[N, L, K]` packed),
    `lengths` `[B]` tokens per trajectory, `cu_seqlens` `[B + 1]` for packed layouts;
    `tokens` `[B, T]` (or `[N]`) int32, the token ids stored with the routes (-1 where
    none were, and past each trajectory's end), None when none were stored."""

    ids: torch.Tensor
    valid: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    origin: Origin = field(default_factory=Origin)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> RouteTensors:
        return _mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> RouteTensors:
        """Page-locked copies for asynchronous copies to the GPU (as is without CUDA)."""
        if not torch.cuda.is_available():
            return self
        return _mapped(self, lambda t: t.pin_memory())

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """`(ids, valid)` of one MoE layer: `[..., K]` each."""
        return self.ids[..., index, :], self.valid[..., index, :]


@dataclass
class CompactRoutes:
    """A micro-batch's routes as they travel: `ids` `[B, T, L, K]` (or `[N, L, K]`
    packed) in the narrowest dtype (or the one `compact` was given), `counts`
    `[B, T, L]` (or `[N, L]`) uint8 chosen slots (0: no route, and padding), `tokens` as
    in `RouteTensors`. Move it, then `widen()` where it will be used."""

    ids: torch.Tensor
    counts: torch.Tensor
    lengths: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    tokens: torch.Tensor | None = None
    origin: Origin = field(default_factory=Origin)

    def to(self, device: torch.device | str, non_blocking: bool = True) -> CompactRoutes:
        return _mapped(self, lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def nbytes(self) -> int:
        """Bytes of the routes (ids and counts; the token ids are 4 bytes a token more)."""
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
        return RouteTensors(ids, valid, self.lengths, self.cu_seqlens, self.tokens, self.origin)


R = TypeVar("R", RouteTensors, CompactRoutes)


def _mapped(routes: R, fn: Callable[[torch.Tensor], torch.Tensor]) -> R:
    """`routes` with `fn` applied to each of its tensors (the optional ones it has)."""
    moved: dict[str, Any] = {
        f.name: fn(value)
        for f in dataclasses.fields(routes)
        if isinstance(value := getattr(routes, f.name), torch.Tensor)
    }
    return dataclasses.replace(routes, **moved)


def as_wide(routes: RouteTensors | CompactRoutes) -> RouteTensors:
    """Routes as the replay paths use them (compact ones widened where they are)."""
    return routes.widen() if isinstance(routes, CompactRoutes) else routes


ID_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)  # of `compact`


def compact_dtype(spec: RouteSpec) -> torch.dtype:
    if spec.num_experts <= 256:
        return torch.uint8
    return torch.int16 if spec.num_experts <= 2**15 else torch.int32


def _ids_dtype(spec: RouteSpec, dtype: torch.dtype | None) -> torch.dtype:
    """The dtype of `compact`'s ids: `dtype` when it is one of `ID_DTYPES` and holds
    every expert id, else refused (a cast would wrap ids silently); the narrowest when
    None."""
    if dtype is None:
        return compact_dtype(spec)
    if dtype not in ID_DTYPES:
        raise InvalidInput(f"route ids cannot be of dtype {dtype}: give one of {ID_DTYPES}")
    if not holds_ids(dtype, spec):
        raise InvalidInput(f"{dtype} cannot hold the ids of {spec.num_experts} experts")
    return dtype


def holds_ids(dtype: torch.dtype, spec: RouteSpec) -> bool:
    """Whether integer `dtype` holds every expert id of `spec`."""
    return torch.iinfo(dtype).max >= spec.num_experts - 1


def _buffer(shape: tuple[int, ...], dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """A buffer not yet written: the caller writes (or zeroes) every element."""
    return torch.empty(shape, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


def _fill(
    ids: np.ndarray,
    counts: np.ndarray,
    where: tuple[int, slice],
    major: Major,
    source: np.ndarray | int,
    count: np.ndarray | int,
) -> None:
    """Write ids `source` (`[L, n, K]`, or one value) and `count` (`[L, n]`, or one value)
    at the tokens `where` (a row, a slice of its tokens) of buffers of `major` order."""
    row, at = where
    if major == "layer":
        np.copyto(ids[row, :, at], source, casting="unsafe")
        counts[row, :, at] = count
        return
    np.copyto(
        ids[row, at],
        _token_major(source) if isinstance(source, np.ndarray) else source,
        casting="unsafe",
    )
    counts[row, at] = count.T if isinstance(count, np.ndarray) else count


def _token_major(layers: np.ndarray) -> np.ndarray:
    """`[L, n, K]` ids as `[n, L, K]`: a token-layer's K ids moved as one word where they
    fit one (a copy of that many words, not of K times as many ids), else a view."""
    words = row_words(layers)
    if words is None:
        return layers.transpose(1, 0, 2)
    moved: np.ndarray = np.ascontiguousarray(words.T).view(layers.dtype)
    return moved.reshape(layers.shape[1], layers.shape[0], layers.shape[2])


def _gaps(spans: list[tuple[int, int]], end: int) -> list[slice]:
    """The parts of `[0, end)` none of `spans` (`(first, past)` each) covers."""
    gaps, at = [], 0
    for first, past in sorted(spans):
        if first > at:
            gaps.append(slice(at, first))
        at = max(at, past)
    return [*gaps, slice(at, end)] if at < end else gaps


def compact(
    batch: Batch,
    spec: RouteSpec,
    layout: Layout = "padded",
    major: Major = "layer",
    pad_to: int | None = None,
    pin: bool = False,
    executor: Executor | None = None,
    namespace: str | None = None,
    dtype: torch.dtype | None = None,
) -> CompactRoutes:
    """The batch's routes as `CompactRoutes`: each trajectory's segments decoded (from
    their stored streams, or taken as decoded) straight into their place in buffers
    allocated once, in parallel on `executor`; with the token ids stored beside them
    when any were, and their origin (`namespace`, the trajectories' ids). The ids are
    of `dtype` when given (one of `ID_DTYPES` that holds every expert id, else
    `InvalidInput`), else the narrowest."""
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
    ids = _buffer((rows, *inner, k), _ids_dtype(spec, dtype), pin)
    counts = _buffer((rows, *inner), torch.uint8, pin)
    ids_np, counts_np = ids.numpy(), counts.numpy()
    tokens = None
    if any(_has_tokens(read) for read in reads):
        tokens = _buffer((rows, width), torch.int32, pin)
        tokens.fill_(-1)
    tokens_np = None if tokens is None else tokens.numpy()
    complete = [True] * len(reads)

    def place(b: int) -> None:
        read, row = reads[b], (b if layout == "padded" else 0)
        written = []
        for begin, routes, stored in _segment_routes(read, spec):
            n = routes.layers.shape[1]
            written.append((begin, begin + n))
            at = slice(offsets[b] + begin, offsets[b] + begin + n)
            count = routes.layer_counts
            _fill(ids_np, counts_np, (row, at), major, routes.layers, k if count is None else count)
            if stored is None or tokens_np is None:
                complete[b] = False
            else:
                tokens_np[row, at] = stored
                complete[b] = complete[b] and not bool((stored < 0).any())
        for gap in _gaps(written, width if layout == "padded" else lengths[b]):
            at = slice(offsets[b] + gap.start, offsets[b] + gap.stop)  # padding: no route
            _fill(ids_np, counts_np, (row, at), major, 0, 0)

    if executor is not None and len(reads) > 1:
        list(executor.map(place, range(len(reads))))
    else:
        for b in range(len(reads)):
            place(b)
    seen_ids = ids.permute(0, 2, 1, 3) if major == "layer" else ids
    seen_counts = counts.permute(0, 2, 1) if major == "layer" else counts
    sizes = torch.tensor(lengths, dtype=torch.int32)
    origin = Origin(
        namespace,
        tuple(r.trajectory_id for r in reads),
        tuple(r.trajectory_id for r, whole in zip(reads, complete, strict=True) if not whole),
        batch.layers,
    )
    if layout == "packed":
        cu = torch.zeros(len(reads) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(sizes, 0)
        packed_tokens = None if tokens is None else tokens[0]
        return CompactRoutes(seen_ids[0], seen_counts[0], sizes, cu, packed_tokens, origin)
    return CompactRoutes(seen_ids, seen_counts, sizes, None, tokens, origin)


def no_layers(
    lengths: Sequence[int],
    trajectory_ids: Sequence[str],
    layout: Layout = "padded",
    namespace: str | None = None,
) -> CompactRoutes:
    """The routes of a read of no layers (a pipeline stage of dense layers only):
    `lengths` tokens each, no token-layer, no token ids; made without reading."""
    sizes = torch.tensor(list(lengths), dtype=torch.int32)
    origin = Origin(namespace, tuple(trajectory_ids), (), ())
    if layout == "packed":
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.cumsum(sizes, 0)
        total = int(cu[-1])
        ids = torch.zeros((total, 0, 0), dtype=torch.uint8)
        return CompactRoutes(
            ids, torch.zeros((total, 0), dtype=torch.uint8), sizes, cu, None, origin
        )
    width = max(lengths, default=0)
    ids = torch.zeros((len(lengths), width, 0, 0), dtype=torch.uint8)
    counts = torch.zeros((len(lengths), width, 0), dtype=torch.uint8)
    return CompactRoutes(ids, counts, sizes, None, None, origin)


def _has_tokens(read: TrajectoryRead) -> bool:
    if read.routes is not None:
        return read.token_ids is not None
    return any(s.encoded is not None and s.encoded.tokens is not None for s in read.segments)


def _segment_routes(
    read: TrajectoryRead, spec: RouteSpec
) -> list[tuple[int, Routes, np.ndarray | None]]:
    """`(first token, routes, token ids)` of each segment: decoded here from stored
    streams, or what the read already holds (all segments joined)."""
    if read.routes is not None:
        return [(0, read.routes, read.token_ids)]
    out = []
    for segment in read.segments:
        if segment.encoded is None:
            raise ValueError(f"{read.trajectory_id}: a read with neither routes nor streams")
        stored = segment.encoded
        tokens = (
            None
            if stored.tokens is None
            else codec.decode_tokens(stored.tokens, segment.num_tokens)
        )
        out.append((segment.start, codec.decode(stored, spec, segment.num_tokens), tokens))
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


def rank_slice(items: Sequence[T], rank: int, world_size: int) -> list[T]:
    """This data-parallel rank's share of a global batch: contiguous and balanced
    (sizes differ by at most one), so no rank needs the others' routes."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, {world_size})")
    per, extra = divmod(len(items), world_size)
    start = rank * per + min(rank, extra)
    return list(items[start : start + per + (1 if rank < extra else 0)])


def micro_batches(items: Sequence[T], size: int) -> list[list[T]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
