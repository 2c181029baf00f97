"""The order in which one rank's Megatron-Core routers see a micro-batch's tokens
(torch required; megatron-core only to read this process's parallel state).

`TokenLayout` names, for each router row of this rank, the micro-batch sequence and
token it routes, from the layout the trainer uses (docs/replay.md states the rules):

- `sbhd`: the router sees `[s, b]` flattened sequence-major (token `s * b + j`).
- `thd` (packed sequences): `[t, 1]`; sequence `i` occupies `[cu_seqlens_padded[i],
  cu_seqlens_padded[i + 1])`, its real tokens first, then padding.
- context parallelism (cp > 1): each sequence (sbhd: the whole batch's sequence axis)
  is cut into `2 * cp` chunks and rank `r` keeps chunks `r` and `2 * cp - 1 - r`, as
  `megatron.core.utils.get_batch_on_this_cp_rank` does; for thd, per sequence.
- sequence parallelism: each tensor-parallel rank's router sees its contiguous slice of
  the (context-parallel local) sequence axis, as `scatter_to_sequence_parallel_region`.

`Parallel` is the rank a layout is declared for, and `check_parallel` refuses a layout
of another rank than this process. `router_tokens` puts the input ids the model is
called with in the order its routers see them by Megatron's own data flow, so that the
token check (`megatron_routes`) can compare them with the layout's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidRoutes


@dataclass(frozen=True)
class Parallel:
    """This rank's place in the tensor- and context-parallel groups.

    `Parallel(tp_size=2, tp_rank=1, sequence_parallel=True, cp_size=2, cp_rank=0)`;
    `Parallel.of_this_rank(config)` reads Megatron's `parallel_state`.
    """

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False
    cp_size: int = 1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        for size, rank, what in (
            (self.tp_size, self.tp_rank, "tp"),
            (self.cp_size, self.cp_rank, "cp"),
        ):
            if size < 1 or not 0 <= rank < size:
                raise ValueError(f"{what} rank {rank} is not in [0, {size})")

    @classmethod
    def of_this_rank(cls, sequence_parallel: bool) -> Parallel:
        from megatron.core import parallel_state

        return cls(
            tp_size=parallel_state.get_tensor_model_parallel_world_size(),
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=sequence_parallel,
            cp_size=parallel_state.get_context_parallel_world_size(),
            cp_rank=parallel_state.get_context_parallel_rank(),
        )


def check_parallel(parallel: Parallel, sequence_parallel: bool | None = None) -> None:
    """Refuse a layout declared for another rank than this process (its tensor- and
    context-parallel size and rank, as Megatron's `parallel_state` has them; no parallel
    state: one rank), and, given the model's `sequence_parallel`, another setting of
    it. The token check cuts the input ids by the declared layout too, so it cannot see
    such a layout: this does."""
    try:
        from megatron.core import parallel_state
    except ImportError as exc:  # pragma: no cover - exercised without megatron-core only
        raise missing("megatron-core", __name__, "megatron") from exc

    sp = parallel.sequence_parallel if sequence_parallel is None else sequence_parallel
    actual = Parallel(sequence_parallel=sp)
    if parallel_state.model_parallel_is_initialized():
        actual = Parallel.of_this_rank(sp)
    declared = (parallel.tp_size, parallel.tp_rank, parallel.cp_size, parallel.cp_rank)
    if declared != (actual.tp_size, actual.tp_rank, actual.cp_size, actual.cp_rank) or (
        actual.tp_size > 1 and parallel.sequence_parallel != sp
    ):
        raise InvalidRoutes(
            f"the layout is declared for {parallel}; this process is {actual} "
            "(Megatron's parallel_state and the model's sequence_parallel): build it with "
            "Parallel.of_this_rank(config.sequence_parallel)"
        )


def _cp_chunks(length: int, cp_size: int, cp_rank: int, what: str) -> torch.Tensor:
    """Offsets within a `length`-long sequence kept by context-parallel rank `cp_rank`."""
    if cp_size == 1:
        return torch.arange(length)
    if length % (2 * cp_size):
        raise ValueError(f"{what} ({length}) is not a multiple of 2 * cp = {2 * cp_size}")
    chunk = length // (2 * cp_size)
    first, second = cp_rank, 2 * cp_size - 1 - cp_rank
    return torch.cat(
        [
            torch.arange(first * chunk, (first + 1) * chunk),
            torch.arange(second * chunk, (second + 1) * chunk),
        ]
    )


def _sp_slice(count: int, parallel: Parallel, what: str) -> slice:
    if not parallel.sequence_parallel or parallel.tp_size == 1:
        return slice(0, count)
    if count % parallel.tp_size:
        raise ValueError(f"{what} ({count}) is not a multiple of tp = {parallel.tp_size}")
    per = count // parallel.tp_size
    return slice(parallel.tp_rank * per, (parallel.tp_rank + 1) * per)


@dataclass(frozen=True)
class TokenLayout:
    """The tokens one rank's routers see, in their order: `sequence[n]`, `token[n]` name
    the micro-batch sequence and its token (both -1 for padding). `lengths` are the
    sequences' real token counts, checked against the routes."""

    sequence: torch.Tensor
    token: torch.Tensor
    lengths: tuple[int, ...]
    parallel: Parallel = Parallel()
    kind: str = "sbhd"

    @property
    def num_tokens(self) -> int:
        return int(self.sequence.numel())

    @classmethod
    def sbhd(
        cls,
        lengths: Sequence[int],
        seq_len: int,
        parallel: Parallel = Parallel(),
        first: Sequence[int] | None = None,
    ) -> TokenLayout:
        """A `[s, b]` batch of `seq_len` positions; sequence `j` starts at position
        `first[j]` (0: right padding) and has `lengths[j]` tokens."""
        lengths = tuple(int(n) for n in lengths)
        first = tuple(int(f) for f in first) if first is not None else (0,) * len(lengths)
        if len(first) != len(lengths):
            raise ValueError("give one first position per sequence")
        for j, (n, f) in enumerate(zip(lengths, first, strict=True)):
            if f < 0 or f + n > seq_len:
                raise ValueError(f"sequence {j} ({n} tokens from {f}) does not fit {seq_len}")
        positions = _cp_chunks(seq_len, parallel.cp_size, parallel.cp_rank, "the sequence length")
        positions = positions[_sp_slice(positions.numel(), parallel, "the local sequence length")]
        batch = len(lengths)
        s = positions.repeat_interleave(batch)  # sequence-major: [s, b] flattened
        b = torch.arange(batch).repeat(positions.numel())
        starts = torch.tensor(first, dtype=torch.long)[b]
        ends = starts + torch.tensor(lengths, dtype=torch.long)[b]
        real = (s >= starts) & (s < ends)
        return cls(torch.where(real, b, -1), torch.where(real, s - starts, -1), lengths, parallel)

    @classmethod
    def thd(
        cls,
        lengths: Sequence[int],
        cu_seqlens_padded: Sequence[int] | torch.Tensor | None = None,
        parallel: Parallel = Parallel(),
    ) -> TokenLayout:
        """Packed sequences: sequence `i` holds `lengths[i]` real tokens at the start of
        `[cu_seqlens_padded[i], cu_seqlens_padded[i + 1])` (default: no padding)."""
        lengths = tuple(int(n) for n in lengths)
        if cu_seqlens_padded is None:
            bounds = [0]
            for n in lengths:
                bounds.append(bounds[-1] + n)
        else:
            bounds = [int(x) for x in torch.as_tensor(cu_seqlens_padded).tolist()]
        if len(bounds) != len(lengths) + 1 or bounds[0] != 0:
            raise ValueError(
                "cu_seqlens_padded must start at 0 and have one entry per sequence + 1"
            )
        sequences, tokens = [], []
        for i, n in enumerate(lengths):
            padded = bounds[i + 1] - bounds[i]
            if padded < n:
                raise ValueError(f"sequence {i}: {n} tokens do not fit its {padded} packed slots")
            offsets = _cp_chunks(
                padded, parallel.cp_size, parallel.cp_rank, f"sequence {i}'s padded length"
            )
            real = offsets < n
            sequences.append(torch.where(real, i, -1))
            tokens.append(torch.where(real, offsets, -1))
        sequence = torch.cat(sequences) if sequences else torch.zeros(0, dtype=torch.long)
        token = torch.cat(tokens) if tokens else torch.zeros(0, dtype=torch.long)
        local = _sp_slice(sequence.numel(), parallel, "the local packed length")
        return cls(sequence[local], token[local], lengths, parallel, "thd")


def router_tokens(input_ids: torch.Tensor, parallel: Parallel = Parallel()) -> torch.Tensor:
    """The token ids this rank's routers see, in their order, from the input ids its
    model is called with (`[b, s]`, context-parallel local; packed: `[1, t]` or `[t]`):
    the embedding's `[s, b]` flattened sequence-major, then, with sequence parallelism,
    this tensor-parallel rank's contiguous slice. This follows Megatron's own data
    flow, not the layout the trainer declares, so a layout that is not the batch's
    gives other tokens than the routes'."""
    if input_ids.dim() == 2:
        flat = input_ids.t().reshape(-1)
    elif input_ids.dim() == 1:
        flat = input_ids
    else:
        raise InvalidRoutes(f"input ids of shape {list(input_ids.shape)}: expected [b, s] or [t]")
    return flat[_sp_slice(flat.numel(), parallel, "the input's token count")]


def seen_by_routers(input_ids: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """`router_tokens` as a view where it can be (no copy): `[s, b]`, this rank's rows
    of it under sequence parallelism; router row `n` is its element `n` row-major."""
    if input_ids.dim() == 2:
        seen = input_ids.t()
        if parallel.sequence_parallel and parallel.tp_size > 1:
            if seen.shape[0] % parallel.tp_size:
                return router_tokens(input_ids, parallel)  # whatever it holds, flat
            seen = seen[_sp_slice(seen.shape[0], parallel, "the input's sequence length")]
        return seen
    return router_tokens(input_ids, parallel)
