"""Rollout Routing Replay through Megatron-Core's own `RouterReplay` (torch and
megatron-core required; both imported only here).

Megatron-Core (`TransformerConfig(moe_enable_routing_replay=True)`) gives every
`TopKRouter` a `RouterReplay` instance, kept in the process-wide list
`RouterReplay.global_router_replay_instances` in build order; `set_replay_data` takes
one `[tokens, top_k]` index tensor per instance, in the order that rank's router sees
its tokens (here each instance is given its own: `set_target_indices`). Getting that
order wrong trains on the wrong experts without an error, so it is computed here from
the layout the trainer uses (docs/replay.md states the rules):

- `sbhd`: the router sees `[s, b]` flattened sequence-major (token `s * b + j`).
- `thd` (packed sequences): `[t, 1]`; sequence `i` occupies `[cu_seqlens_padded[i],
  cu_seqlens_padded[i + 1])`, its real tokens first, then padding.
- context parallelism (cp > 1): each sequence (sbhd: the whole batch's sequence axis)
  is cut into `2 * cp` chunks and rank `r` keeps chunks `r` and `2 * cp - 1 - r`, as
  `megatron.core.utils.get_batch_on_this_cp_rank` does; for thd, per sequence.
- sequence parallelism: each tensor-parallel rank's router sees its contiguous slice of
  the (context-parallel local) sequence axis, as `scatter_to_sequence_parallel_region`.
- pipeline parallelism: a stage holds only its MoE layers' routers (virtual stages
  chunk by chunk; dense layers have none); each is mapped to r3store's layer axis by
  its global layer number.

Token-layers without a recorded route (padding, the last sampled token, a prompt the
engine did not route) are given to Megatron as `-1` rows, and replay falls back to the
live router for exactly those rows; they are never replayed as expert 0.

A wrong order or layout would still replay silently; so routes that carry the token
ids stored with them are checked against the input ids the model is called with, put
in the order this rank's routers see them by Megatron's own data flow (`router_tokens`),
on the device; the outcome is read before backward and raises `TokenMismatch` naming
the trajectory and its first differing token. Each `MegatronReplay` drives only its
own model's `RouterReplay` instances, so several models replay side by side, and a
pipeline stage without MoE layers replays nothing.

    replay = MegatronReplay(model, spec)              # checks the model against the spec
    layout = TokenLayout.sbhd(lengths, seq_len=4096, parallel=Parallel.of_this_rank())
    with replay.micro_batch(routes, layout) as step:  # clears, loads, REPLAY_FORWARD
        loss = forward(model, batch)                  # the input ids checked
        step.backward(loss)                           # checks read, REPLAY_BACKWARD

One module on purpose (over 500 lines): the token order each rank's routers see
(`TokenLayout`, `Parallel`) and the replay that loads it into Megatron's `RouterReplay`
are one contract with Megatron-Core, checked against each other, and this is the only
module that imports megatron-core.
"""

from __future__ import annotations

import types
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from r3store_client.extras import missing

try:
    import torch
    from torch import nn
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidRoutes
from r3store.spec import RouteSpec
from r3store_client.replay import Gate, check_gate
from r3store_client.tensors import (
    CompactRoutes,
    Origin,
    RouteTensors,
    TokenCheck,
    as_wide,
    warn_untokened,
)


def _megatron() -> Any:
    try:
        from megatron.core.transformer.moe import router, router_replay
    except ImportError as exc:  # pragma: no cover - exercised without megatron-core only
        raise missing("megatron-core", __name__, "megatron") from exc
    return types.SimpleNamespace(
        TopKRouter=router.TopKRouter,
        RouterReplay=router_replay.RouterReplay,
        Action=router_replay.RouterReplayAction,
    )


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


def layer_indices(
    routes: RouteTensors | CompactRoutes, layout: TokenLayout, layers: Sequence[int]
) -> list[torch.Tensor]:
    """Per MoE layer in `layers` (indices into the routes' layer axis), the `[N, K]`
    int64 expert ids of the tokens `layout` names, in its order; `-1` rows where no
    route was recorded (or for padding). A token-layer with fewer than K experts cannot
    be replayed by Megatron's top-k and is refused."""
    return _replay_data(as_wide(routes), layout, layers)[0]


def _replay_data(
    routes: RouteTensors, layout: TokenLayout, layers: Sequence[int], tokens: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`layer_indices`, on the routes' device, with (if `tokens`) the stored token of
    each router row (-1: padding, or none stored) from the same gather; the host reads
    one small tensor (partial rows, and the layers with rows for the live router)."""
    if routes.ids.dim() != 4:
        raise InvalidRoutes("Megatron replay takes padded routes [B, T, L, K]")
    _line_up(routes, layout)
    length = routes.ids.shape[1]
    device = routes.ids.device
    sequence = layout.sequence.to(device, non_blocking=True)
    real = sequence >= 0
    seq = sequence.clamp(min=0)
    tok = layout.token.to(device, non_blocking=True).clamp(min=0, max=max(length - 1, 0))
    ids = routes.ids[seq, tok]  # [N, L, K]
    valid = routes.valid[seq, tok] & real[:, None, None]
    full = valid.all(dim=-1)  # [N, L]
    partial = valid.any(dim=-1) & ~full
    flags = torch.cat([partial.any()[None], (~full).any(dim=0)]).tolist()
    if flags[0]:
        n, layer = (int(x) for x in partial.nonzero()[0])
        raise InvalidRoutes(
            f"sequence {int(layout.sequence[n])}, token {int(layout.token[n])}, layer "
            f"{layer} has fewer than top_k experts: Megatron's top-k cannot replay it"
        )
    out = []
    for layer in layers:
        chosen = ids[:, layer, :].to(torch.int64)
        data = torch.where(full[:, layer, None], chosen, torch.full_like(chosen, -1))
        data._r3_live = flags[1 + layer]  # type: ignore[attr-defined]  # rows for the live router
        out.append(data)
    want = None
    if tokens and routes.tokens is not None:
        if routes.tokens.dim() != 2:
            raise InvalidRoutes("the token check takes padded routes' tokens [B, T]")
        stored = routes.tokens.to(device, non_blocking=True)
        want = torch.where(real, stored[seq, tok.clamp(max=max(stored.shape[1] - 1, 0))], -1)
    return out, want


def _line_up(routes: RouteTensors | CompactRoutes, layout: TokenLayout) -> None:
    """Refuse routes of another sequence count or lengths than the layout's."""
    have = tuple(int(n) for n in routes.lengths.tolist())
    if len(have) != len(layout.lengths):
        raise InvalidRoutes(
            f"routes do not line up with the batch: the batch has {len(layout.lengths)} "
            f"sequences, the routes {len(have)}"
        )
    for i, (ours, theirs) in enumerate(zip(have, layout.lengths, strict=True)):
        if ours != theirs:
            raise InvalidRoutes(
                f"routes do not line up with the batch: sequence {i} has {theirs} tokens "
                f"in the batch but {ours} in the routes"
            )


def _with_live(data: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`data` carrying `like`'s note of whether it has rows for the live router."""
    data._r3_live = getattr(like, "_r3_live", None)  # type: ignore[attr-defined]
    return data


def _replay_topk(
    self: Any,
    scores: torch.Tensor,
    topk: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    default_compute_topk: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`RouterReplay.get_replay_topk` with a fallback: `-1` rows take the live router's
    top-k; the others are replayed exactly as Megatron does (scores gathered at the
    replayed experts). Whether a layer has such rows was noted when it was loaded
    (`layer_indices`), so the host never waits on the device here, once per layer."""
    action = self.router_replay_action
    replaying = action in (self._r3_actions.REPLAY_FORWARD, self._r3_actions.REPLAY_BACKWARD)
    if not replaying:
        result: tuple[torch.Tensor, torch.Tensor] = self._r3_original(
            scores, topk, num_groups, group_topk, default_compute_topk
        )
        return result
    if action == self._r3_actions.REPLAY_FORWARD:
        indices = self.target_topk_idx
    else:
        indices = self.replay_backward_list.pop(0)
    if indices is None:
        raise RuntimeError("router replay is on but no routes were loaded for this layer")
    live_rows = getattr(indices, "_r3_live", None)  # known when loaded: no read per layer
    indices = indices.to(scores.device)
    if indices.shape != (scores.shape[0], topk):
        raise InvalidRoutes(
            f"a router sees {scores.shape[0]} tokens with top-{topk}; the replayed routes "
            f"are {list(indices.shape)}"
        )
    live = (indices < 0).any(dim=-1, keepdim=True)
    if live_rows if live_rows is not None else bool(live.any()):
        _probs, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
        indices = torch.where(live, chosen, indices)
    return scores.gather(1, indices), indices


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


def _seen_by_routers(input_ids: torch.Tensor, parallel: Parallel) -> torch.Tensor:
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


@dataclass(frozen=True)
class _Expected:
    """The stored token of each of this rank's router rows (-1: padding, or none
    stored), made once per micro-batch."""

    want: torch.Tensor
    origin: Origin
    layout: TokenLayout

    def compare(self, input_ids: torch.Tensor) -> TokenCheck:
        got = _seen_by_routers(input_ids, self.layout.parallel)
        if got.numel() != self.want.numel():
            raise InvalidRoutes(
                f"the model's input ids {list(input_ids.shape)} give this rank's routers "
                f"{got.numel()} tokens; the {self.layout.kind} layout {self.want.numel()}: "
                "the layout is not the batch's"
            )
        want = self.want.view(got.shape)
        if got.device != want.device:  # compared where the model runs: no copy back
            want = want.to(got.device, non_blocking=True)
        return TokenCheck(
            want,
            got,
            self.origin,
            f"the {self.layout.kind} layout is not the batch's (thd or sbhd, first= for "
            "left padding, cu_seqlens_padded, tensor/context/sequence parallelism)",
            self._locate,
        )

    def _locate(self, rows: Any) -> tuple[Any, Any]:
        return self.layout.sequence.numpy()[rows], self.layout.token.numpy()[rows]


def _expected(tokens: torch.Tensor | None, layout: TokenLayout, origin: Origin) -> _Expected | None:
    """The stored token of each router row of `layout`, from the routes' `tokens`
    `[B, T]`, on their device."""
    if tokens is None:
        return None
    if tokens.dim() != 2:
        raise InvalidRoutes("the token check takes padded routes' tokens [B, T]")
    sequence = layout.sequence.to(tokens.device, non_blocking=True)
    index = sequence * tokens.shape[1] + layout.token.to(tokens.device, non_blocking=True)
    want = torch.where(sequence >= 0, tokens.reshape(-1)[index.clamp(min=0)], -1)
    return _Expected(want, origin, layout)


def check_tokens(
    routes: RouteTensors | CompactRoutes, layout: TokenLayout, input_ids: torch.Tensor
) -> TokenCheck | None:
    """The token check `MegatronReplay` makes, on its own: `input_ids` as this rank's
    model is called with them, against the routes' stored tokens in the layout's
    order. `verify()` on the result raises `TokenMismatch`; None when the routes carry
    no token ids. A layout of another rank than this process is refused
    (`check_parallel`)."""
    check_parallel(layout.parallel)
    _line_up(routes, layout)
    expected = _expected(routes.tokens, layout, routes.origin)
    return None if expected is None else expected.compare(input_ids)


def megatron_gate(config: Any) -> Gate:
    """The gate a Megatron router of `config` applies (`topk_routing_with_score_function`):
    softmax before top-k (`moe_router_pre_softmax`) keeps the k probabilities as they
    are, softmax after it normalises them; sigmoid scores are normalised for top-k > 1;
    `moe_router_enable_expert_bias` adds a bias that only chooses."""
    score = config.moe_router_score_function
    if score == "softmax":
        normalised = not config.moe_router_pre_softmax or config.moe_router_topk == 1
    else:
        normalised = config.moe_router_topk > 1
    return Gate(score, normalised, bool(config.moe_router_enable_expert_bias))


def _config_of(chunks: Sequence[nn.Module]) -> Any:
    """The transformer config of a model without routers (a stage of dense layers)."""
    for chunk in chunks:
        for module in chunk.modules():
            config = getattr(module, "config", None)
            if config is not None and hasattr(config, "moe_router_topk"):
                return config
    return None


def _owner(instance: Any) -> MegatronReplay | None:
    ref = getattr(instance, "_r3_owner", None)
    owner: MegatronReplay | None = None if ref is None else ref()
    return owner


def _input_ids_hook(ref: Callable[[], MegatronReplay | None]) -> Callable[..., None]:
    """A chunk's forward pre-hook: its input ids to the token check of the replay
    behind `ref` (weak: the hook keeps nothing alive)."""

    def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        replay = ref()
        if replay is None or replay._expected is None:
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and not ids.is_floating_point() and ids.dim() <= 2:
            replay._pending.append(replay._expected.compare(ids))
            replay._unchecked = False

    return hook


class MegatronReplay:
    """Megatron-Core's `RouterReplay` driven with r3store's routes, for one model.

    `model` is a module or the list of virtual-pipeline chunks this rank holds.
    Attaching checks the routers against `spec` (top-k, experts, MoE layer count, the
    gate against the spec's `model` when set; configurations under which Megatron would
    skip or alter replay are refused). Each `MegatronReplay` drives its own model's
    `RouterReplay` instances only, never through the process-wide list, so several
    models (an actor and a reference model, say) replay side by side; the list is kept
    to the instances of attached models, so those of a temporary model built for weight
    extraction neither leak nor shift anything. A stage without MoE layers (dense
    layers only) attaches and does nothing.

    `layers[i]` is the r3store layer of this rank's i-th router (default: from the
    routers' global layer numbers and the config's MoE layer pattern).

    `check_tokens` (default on): routes that carry their stored token ids are checked
    against the input ids each chunk's forward is called with (or `tokens=` given to
    `micro_batch`/`queue`), in the order this rank's routers see them; the outcome is
    read before backward and at the end of the micro-batch, and a mismatch raises
    `TokenMismatch` naming the trajectory and the first differing token; a check that
    never ran (a stage whose forward got no input ids, and no `tokens=`) raises
    `InvalidRoutes` there too. Routes without token ids are replayed unchecked, said
    once per namespace (`TokensNotChecked`). A layout declared for another rank than
    this process is refused when loaded (`check_parallel`).
    """

    def __init__(
        self,
        model: nn.Module | Sequence[nn.Module],
        spec: RouteSpec,
        layers: Sequence[int] | None = None,
        *,
        check_tokens: bool = True,
    ) -> None:
        self._m = _megatron()
        self.chunks = [model] if isinstance(model, nn.Module) else list(model)
        routers = [
            m for chunk in self.chunks for m in chunk.modules() if isinstance(m, self._m.TopKRouter)
        ]
        config = routers[0].config if routers else _config_of(self.chunks)
        if config is not None:
            self._check(config, spec)
        self._sequence_parallel = None if config is None else bool(config.sequence_parallel)
        missing = [r.layer_number for r in routers if r.router_replay is None]
        if missing:
            raise ValueError(
                f"routers of layers {missing} have no RouterReplay: build the model with "
                "TransformerConfig(moe_enable_routing_replay=True)"
            )
        self.spec = spec
        self.check_tokens = check_tokens
        self.routers = routers
        if layers is not None:
            self.layers = list(layers)
        else:
            self.layers = self._layer_map(config, spec, routers) if routers else []
        if len(self.layers) != len(routers):
            raise ValueError(f"{len(self.layers)} layers given for {len(routers)} routers")
        bad = [layer for layer in self.layers if not 0 <= layer < spec.num_layers]
        if bad:
            raise ValueError(f"layers {bad} are outside the routes' {spec.num_layers} layers")
        self.instances = [r.router_replay for r in routers]
        self._expected: _Expected | None = None
        self._pending: list[TokenCheck] = []
        self._unchecked = False  # routes with token ids loaded, no input ids compared yet
        self._attached = True
        for instance in self.instances:
            instance.__dict__.pop("get_replay_topk", None)  # attached before: start afresh
            instance._r3_original = instance.get_replay_topk
            instance._r3_actions = self._m.Action
            instance.get_replay_topk = types.MethodType(_replay_topk, instance)
            instance._r3_owner = weakref.ref(self)
        mine = {id(i) for i in self.instances}
        registry = self._m.RouterReplay.global_router_replay_instances
        registry[:] = [
            i for i in registry if id(i) not in mine and _owner(i) is not None
        ] + self.instances  # attached models' instances; a temporary model's are dropped
        hook = _input_ids_hook(weakref.ref(self))
        self._hooks = (
            [chunk.register_forward_pre_hook(hook, with_kwargs=True) for chunk in self.chunks]
            if self.instances
            else []
        )

    @staticmethod
    def _check(config: Any, spec: RouteSpec) -> None:
        problems = []
        if config.moe_router_topk != spec.top_k:
            problems.append(f"top-k {config.moe_router_topk} (routes: {spec.top_k})")
        if config.num_moe_experts != spec.num_experts:
            problems.append(f"{config.num_moe_experts} experts (routes: {spec.num_experts})")
        if getattr(config, "moe_router_fusion", False):
            problems.append("moe_router_fusion (the fused top-k bypasses replay)")
        if config.moe_router_load_balancing_type == "sinkhorn" or (
            isinstance(config.moe_router_load_balancing_type, list)
            and "sinkhorn" in config.moe_router_load_balancing_type
        ):
            problems.append("sinkhorn routing (it bypasses replay)")
        if getattr(config, "moe_router_force_load_balancing", False):
            problems.append("moe_router_force_load_balancing (random logits, for benchmarks)")
        if config.moe_expert_capacity_factor is not None:
            problems.append(
                "moe_expert_capacity_factor (token dropping would drop replayed experts)"
            )
        if problems:
            raise ValueError("the model does not match the routes: " + "; ".join(problems))
        check_gate(spec.model, megatron_gate(config), "the Megatron config's router")

    @staticmethod
    def _layer_map(config: Any, spec: RouteSpec, routers: list[Any]) -> list[int]:
        """r3store layer of each router: its position among the model's MoE layers when
        the routes hold only MoE layers, its layer number when they hold every layer."""
        freq = config.moe_layer_freq
        if isinstance(freq, int):
            pattern = [1 if i % freq == 0 else 0 for i in range(config.num_layers)]
        else:
            pattern = list(freq)
        moe_numbers = [i + 1 for i, is_moe in enumerate(pattern) if is_moe]
        numbers = [r.layer_number for r in routers]
        if spec.num_layers == len(moe_numbers):
            where = {n: i for i, n in enumerate(moe_numbers)}
            unknown = [n for n in numbers if n not in where]
            if unknown:
                raise ValueError(f"routers of layers {unknown} are not MoE layers of the config")
            return [where[n] for n in numbers]
        if spec.num_layers == config.num_layers:
            return [n - 1 for n in numbers]
        raise ValueError(
            f"the routes have {spec.num_layers} layers; the model has {len(moe_numbers)} "
            f"MoE layers of {config.num_layers}: give `layers` explicitly"
        )

    def _mine(self) -> None:
        """Refuse to drive routers this replay no longer owns."""
        if not self._attached:
            raise RuntimeError("this MegatronReplay was detached")
        if any(_owner(i) is not self for i in self.instances):
            raise RuntimeError(
                "another MegatronReplay was attached to this model's routers since: drive "
                "them through that one"
            )

    def _act(self, action: Any) -> None:
        for instance in self.instances:
            instance.set_router_replay_action(action)

    def detach(self) -> None:
        """Give the routers back their own top-k and take them out of the instance list."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        mine = {id(i) for i in self.instances if _owner(i) is self}  # not attached again
        for instance in self.instances:
            if id(instance) in mine:
                instance.__dict__.pop("get_replay_topk", None)  # Megatron's own method again
                instance._r3_owner = None
                instance.clear_indices()
                instance.clear_router_replay_action()
        registry = self._m.RouterReplay.global_router_replay_instances
        registry[:] = [r for r in registry if id(r) not in mine]
        self._attached = False
        self._expected, self._pending, self._unchecked = None, [], False

    def indices(
        self, routes: RouteTensors | CompactRoutes, layout: TokenLayout
    ) -> list[torch.Tensor]:
        """What `set_replay_data` gets: one `[N, K]` tensor per router of this rank."""
        return layer_indices(routes, layout, self._axis(routes))

    @property
    def needed_layers(self) -> list[int]:
        """The namespace's layers this rank's routers replay, increasing: what to read
        (`Client.resolve(refs, layers=replay.needed_layers)`) so no other layer travels."""
        return sorted(set(self.layers))

    def _axis(self, routes: RouteTensors | CompactRoutes) -> list[int]:
        """Each router's index into the routes' layer axis: its layer, or where a read
        of some layers holds it (refused when it holds another set)."""
        held = routes.origin.layers
        if held is None:
            return self.layers
        where = {layer: i for i, layer in enumerate(held)}
        absent = [layer for layer in self.layers if layer not in where]
        if absent:
            raise ValueError(
                f"these routes hold layers {list(held)[:8]}, not this rank's layers "
                f"{absent[:8]}: read them with layers=replay.needed_layers"
            )
        return [where[layer] for layer in self.layers]

    def load(
        self,
        routes: RouteTensors | CompactRoutes,
        layout: TokenLayout,
        device: Any = None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """Clear what earlier micro-batches left, load this one's routes, and replay
        them in the forward pass (`REPLAY_FORWARD`)."""
        self.new_step()
        self.queue(routes, layout, device, tokens)

    def new_step(self) -> None:
        """Forget every queued micro-batch (start of a training step), after reading the
        token checks of those not read yet."""
        self.verify()
        for instance in self.instances:
            instance.clear_indices()

    def queue(
        self,
        routes: RouteTensors | CompactRoutes,
        layout: TokenLayout,
        device: Any = None,
        tokens: torch.Tensor | None = None,
    ) -> None:
        """Load a micro-batch's routes without forgetting earlier ones, for pipeline
        schedules that run several forwards before their backwards: the forward replays
        the latest, recomputation during backward takes them in the order queued.
        `tokens`: this rank's model input ids, checked now (else each chunk's forward
        hands its own to the check)."""
        self._mine()
        if not self.instances:
            return  # a stage without MoE layers: nothing to replay
        check_parallel(layout.parallel, self._sequence_parallel)
        if device is not None and isinstance(routes, CompactRoutes):
            routes = routes.to(device)  # a byte a slot across; widened there
        wide = as_wide(routes)
        if self.check_tokens:
            warn_untokened(wide.tokens, wide.origin)
        data, want = _replay_data(wide, layout, self._axis(wide), tokens=self.check_tokens)
        if device is not None:
            data = [_with_live(d.to(device, non_blocking=True), d) for d in data]
            want = None if want is None else want.to(device, non_blocking=True)
        expected = None if want is None else _Expected(want, wide.origin, layout)
        for instance, indices in zip(self.instances, data, strict=True):
            instance.set_target_indices(indices)
        self._act(self._m.Action.REPLAY_FORWARD)
        self._expected = expected
        self._unchecked = expected is not None
        if expected is not None and tokens is not None:
            self._pending.append(expected.compare(tokens))
            self._unchecked = False

    def verify(self) -> None:
        """Raise `TokenMismatch` if a micro-batch loaded since the last call was given
        other tokens than its routes' (`before_backward` and the end of `micro_batch`
        call it; on a GPU it waits only for the comparisons, queued long before).
        Routes that carry token ids whose check never ran (no chunk's forward was given
        input ids, as on every pipeline stage but the first, and no `tokens=`) raise
        `InvalidRoutes`: pass the stage's input ids as `tokens=`, or build the replay
        with `check_tokens=False` to replay unchecked."""
        pending, self._pending = self._pending, []
        for check in pending:
            check.verify()
        if self._unchecked:
            self._unchecked = False
            raise InvalidRoutes(
                "the token check did not run: no forward of this stage's model was given "
                "input ids since the routes were loaded (a pipeline stage after the first "
                "gets hidden states): pass this micro-batch's input ids as tokens= to "
                "micro_batch or queue, or build MegatronReplay(..., check_tokens=False) "
                "to replay unchecked"
            )

    def before_backward(self) -> None:
        """Recomputation during backward replays the same routes (`REPLAY_BACKWARD`),
        once the token checks of the forwards have passed."""
        self.verify()
        self._act(self._m.Action.REPLAY_BACKWARD)

    def finish(self) -> None:
        """Forget the routes and checks of this step; the routers route live again."""
        self._expected, self._pending, self._unchecked = None, [], False
        for instance in self.instances:
            instance.clear_indices()
            instance.clear_router_replay_action()

    @contextmanager
    def micro_batch(
        self,
        routes: RouteTensors | CompactRoutes,
        layout: TokenLayout,
        device: Any = None,
        tokens: torch.Tensor | None = None,
    ) -> Iterator[MicroBatch]:
        self.load(routes, layout, device, tokens)
        try:
            yield MicroBatch(self)
            self.verify()
        finally:
            self.finish()

    @contextmanager
    def record(self) -> Iterator[list[torch.Tensor]]:
        """Let the live routers choose and record their top-k (`RECORD`); the list is
        filled with one `[N, K]` tensor per router of this model when the block ends."""
        self._mine()
        recorded: list[torch.Tensor] = []
        self.verify()
        self.finish()
        self._act(self._m.Action.RECORD)
        try:
            yield recorded
            recorded.extend(i.get_recorded_indices() for i in self.instances)
        finally:
            self.finish()


@dataclass
class MicroBatch:
    replay: MegatronReplay

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with recomputation replaying this micro-batch's routes."""
        self.replay.before_backward()
        loss.backward()  # type: ignore[no-untyped-call]


def gather_recorded(
    recorded: Sequence[torch.Tensor], layout: TokenLayout, layers: Sequence[int], spec: RouteSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `layer_indices` for what one rank's routers recorded: `[B, T, L, K]`
    ids (int32) and a `[B, T, L]` mask of the token-layers this rank saw."""
    batch = len(layout.lengths)
    length = max(layout.lengths, default=0)
    ids = torch.zeros((batch, length, spec.num_layers, spec.top_k), dtype=torch.int32)
    seen = torch.zeros((batch, length, spec.num_layers), dtype=torch.bool)
    real = layout.sequence >= 0
    seq, tok = layout.sequence[real], layout.token[real]
    for data, layer in zip(recorded, layers, strict=True):
        ids[seq, tok, layer] = data[real].to(torch.int32).cpu()
        seen[seq, tok, layer] = True
    return ids, seen
