"""Rollout Routing Replay through Megatron-Core's own `RouterReplay` (torch and
megatron-core required).

Megatron-Core (`TransformerConfig(moe_enable_routing_replay=True)`) gives every
`TopKRouter` a `RouterReplay` instance, kept in the process-wide list
`RouterReplay.global_router_replay_instances` in build order; `set_replay_data` takes
one `[tokens, top_k]` index tensor per instance, in the order that rank's router sees
its tokens (here each instance is given its own: `set_target_indices`). Getting that
order wrong trains on the wrong experts without an error, so it is computed from the
layout the trainer uses (`TokenLayout`, `Parallel`: `megatron_layout`; docs/replay.md
states the rules), and the routes are put in that order by `megatron_routes`. With
pipeline parallelism a stage holds only its MoE layers' routers (virtual stages chunk
by chunk; dense layers have none); each is mapped to r3store's layer axis by its global
layer number.

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
from r3store_client.gates import check_gate, megatron_gate
from r3store_client.megatron_layout import Parallel, TokenLayout, check_parallel, router_tokens
from r3store_client.megatron_routes import (
    ExpectedTokens,
    check_tokens,
    gather_recorded,
    layer_indices,
    live_rows,
    noted,
    replay_data,
)
from r3store_client.tensors import CompactRoutes, RouteTensors, as_wide
from r3store_client.token_check import TokenCheck, warn_untokened

__all__ = [
    "MegatronReplay",
    "MicroBatch",
    "Parallel",
    "TokenLayout",
    "check_tokens",
    "gather_recorded",
    "router_tokens",
]


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
    known = live_rows(indices)  # noted when loaded: no read per layer
    indices = indices.to(scores.device)
    if indices.shape != (scores.shape[0], topk):
        raise InvalidRoutes(
            f"a router sees {scores.shape[0]} tokens with top-{topk}; the replayed routes "
            f"are {list(indices.shape)}"
        )
    live = (indices < 0).any(dim=-1, keepdim=True)
    if known if known is not None else bool(live.any()):
        _probs, chosen = default_compute_topk(scores, topk, num_groups, group_topk)
        indices = torch.where(live, chosen, indices)
    return scores.gather(1, indices), indices


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
        self._expected: ExpectedTokens | None = None
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
        data, want = replay_data(wide, layout, self._axis(wide), tokens=self.check_tokens)
        if device is not None:
            data = [noted(d.to(device, non_blocking=True), live_rows(d)) for d in data]
            want = None if want is None else want.to(device, non_blocking=True)
        expected = None if want is None else ExpectedTokens(want, wide.origin, layout)
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
        torch.autograd.backward(loss)
