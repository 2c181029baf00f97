"""Rollout Routing Replay in HF transformers models (torch required).

R3: the trainer runs the experts the engine chose, with gate weights its own router
computes from its own logits at those experts, so the router still learns. Routers
differ in their gate (softmax or sigmoid, renormalised or not, correction biases that
only choose, group-limited top-k, scaling factors, float32 or the model's dtype), and a
replay that applies the wrong one changes the model's output without an error. So
`RouterReplay` does not re-implement any gate: it runs each router's own forward and
replaces only its final top-k over all experts with the replayed experts (the values
gathered from the very tensor the router ranks). It hooks only the router classes it
knows (`r3store_client.hf_routers.FAMILIES`) and refuses any other model.

    replayer = RouterReplay(model, spec)   # spec: optional, checked against the model
    with replayer.replay(routes):          # RouteTensors [B, T, L, K] matching the input
        out = model(input_ids)             # input_ids checked against the stored tokens
    replayer.agreement                     # per layer: live top-k == replayed set
    with replayer.record() as recorded:    # capture the live routes instead
        model(input_ids)
    recorded.ids                           # [B, T, L, K], in each router's slot order

Routers see the batch flattened row-major: token `b * T + t`. Token-layers with no
recorded route fall back to the live router. A token-layer with fewer than K experts
cannot be replayed by a top-k router and is refused. Replay is exact in `eval()`;
in training, routers with jitter (Mixtral, MiniMax) perturb their own logits first.

Routes that carry the token ids stored with them are checked against each forward's
`input_ids` on the device; the block raises `TokenMismatch` at its end, naming the
trajectory and the first differing token (`check_tokens=False` turns it off). The
gates of the routers and of released models (`r3store_client.gates`: `Gate`,
`MODEL_GATES`) are compared at attach when the spec names its model
(`RouterReplay(model, spec)`); the router families replay knows are in `hf_routers`.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from r3store_client.extras import missing

try:
    import torch
    from torch import SymInt, nn
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidRoutes
from r3store.spec import RouteSpec
from r3store_client.gates import MODEL_GATES as MODEL_GATES
from r3store_client.gates import check_gate, hf_gate
from r3store_client.hf_routers import FAMILIES, Family, supported
from r3store_client.tensors import CompactRoutes, RouteTensors, as_wide
from r3store_client.token_check import TokenCheck, warn_once, warn_untokened


def router_family(module: nn.Module) -> Family | None:
    return FAMILIES.get(type(module).__name__)


def looks_like_router(module: nn.Module) -> bool:
    """A module named like a router, known or not (to refuse unknown ones)."""
    name = type(module).__name__
    gate = name.endswith("Gate") and hasattr(module, "top_k")  # not a recurrent forget gate
    return name in FAMILIES or "Router" in name or name.endswith("Gating") or gate


def _experts(router: nn.Module, family: Family) -> int:
    weight: Any = functools.reduce(getattr, family.weight.split("."), router)
    return int(weight.shape[0])


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: the rows of `a` and `b` `[N, K]` hold the same experts."""
    return (a.sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


_ORIGINAL_TOPK = torch.topk
_ORIGINAL_TENSOR_TOPK = torch.Tensor.topk


@dataclass
class _Substitution:
    """One router call's replacement of its final top-k: `ids` `[N, K]` where `live`
    rows keep the router's own choice."""

    experts: int
    ids: torch.Tensor
    live: torch.Tensor
    thread: int = field(default_factory=threading.get_ident)
    chosen: torch.Tensor | None = None  # what the router ends up with
    own: torch.Tensor | None = None  # what it would have chosen
    matches: int = 0

    def applies(self, scores: torch.Tensor, k: int | SymInt, dim: int, largest: bool) -> bool:
        return (
            threading.get_ident() == self.thread
            and scores.dim() == 2
            and scores.shape == (self.ids.shape[0], self.experts)
            and k == self.ids.shape[1]
            and dim in (-1, 1)
            and largest
        )

    def topk(
        self, scores: torch.Tensor, k: int | SymInt, dim: int, largest: bool, sorted: bool
    ) -> torch.return_types.topk:
        own = _ORIGINAL_TOPK(scores, k, dim=dim, largest=largest, sorted=sorted)
        if not self.applies(scores, k, dim, largest):
            return own
        self.matches += 1
        ids = self.ids.to(scores.device)
        ids = torch.where(self.live.to(scores.device)[:, None], own.indices, ids)
        self.own, self.chosen = own.indices, ids
        return torch.return_types.topk((scores.gather(-1, ids), ids))


_active = threading.local()


def _topk(
    input: torch.Tensor,
    k: int | SymInt,
    dim: int = -1,
    largest: bool = True,
    sorted: bool = True,
    *,
    out: torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor] | None = None,
) -> torch.return_types.topk:
    """`torch.topk` (and `Tensor.topk`), of the same signature, through this thread's
    substitution while one is active."""
    substitution: _Substitution | None = getattr(_active, "substitution", None)
    if substitution is None or out is not None:
        return _ORIGINAL_TOPK(input, k, dim=dim, largest=largest, sorted=sorted, out=out)
    return substitution.topk(input, k, dim, largest, sorted)


_patch_lock = threading.Lock()
_patch_users = 0


@contextmanager
def _topk_substituted(substitution: _Substitution) -> Iterator[_Substitution]:
    """`torch.topk` and `Tensor.topk` route this thread's calls through `substitution`
    while the block runs."""
    global _patch_users
    with _patch_lock:
        if _patch_users == 0:
            torch.topk = _topk
            torch.Tensor.topk = _topk  # type: ignore[method-assign,assignment]
        _patch_users += 1
    _active.substitution = substitution
    try:
        yield substitution
    finally:
        _active.substitution = None
        with _patch_lock:
            _patch_users -= 1
            if _patch_users == 0:
                torch.topk = _ORIGINAL_TOPK
                torch.Tensor.topk = _ORIGINAL_TENSOR_TOPK  # type: ignore[method-assign]


@contextmanager
def _input_ids_to(model: nn.Module, compare: Callable[[torch.Tensor], None]) -> Iterator[None]:
    """The model's forward hands its `input_ids` (keyword or first argument) to
    `compare` first, inside the block: a wrapper of the forward it has (an override
    such as accelerate's included), restored after; cheaper than a forward hook."""
    previous = model.__dict__.get("forward")
    original = model.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        ids = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
            compare(ids)
        return original(*args, **kwargs)

    model.forward = forward
    try:
        yield
    finally:
        if previous is None:
            model.__dict__.pop("forward", None)
        else:
            model.forward = previous


@dataclass
class Recorded:
    """Live routes captured per layer, assembled as `[B, T, L, K]` int32."""

    layers: list[torch.Tensor] = field(default_factory=list)
    shape: tuple[int, int] = (0, 0)

    @property
    def ids(self) -> torch.Tensor:
        b, t = self.shape
        return torch.stack([x.reshape(b, t, -1) for x in self.layers], dim=2).to(torch.int32)


class RouterReplay:
    """Replay of r3store's routes in an HF transformers model's known routers.

    `spec` (the namespace's, optional): checked at once against the model (MoE layer
    count, experts, top-k, and its gate against the spec's `model` when set).
    `check_tokens` (default on): when the routes carry the token ids stored with them,
    every replayed forward checks its `input_ids` against them on the device and the
    block raises `TokenMismatch` at its end naming the trajectory and the first token
    that differs; routes stored without token ids are replayed unchecked, said once
    per namespace (`TokensNotChecked`). `check_tokens=False` turns both off.
    """

    def __init__(
        self, model: nn.Module, spec: RouteSpec | None = None, *, check_tokens: bool = True
    ) -> None:
        self.model = model
        self.check_tokens = check_tokens
        unknown = sorted(
            {
                type(m).__name__
                for m in model.modules()
                if looks_like_router(m) and router_family(m) is None
            }
        )
        if unknown:
            raise ValueError(
                f"router {', '.join(unknown)} is not one replay knows the gate of "
                f"(known: {supported()})"
            )
        known = [(m, family) for m in model.modules() if (family := router_family(m)) is not None]
        self.routers = [m for m, _family in known]
        if not self.routers:
            raise ValueError(f"no MoE router replay knows in the model (known: {supported()})")
        if getattr(model, "use_kernels", False):
            raise ValueError(
                "the model uses hub kernels (use_kernels), which replace MoE blocks and "
                "routers: replay cannot reach them"
            )
        self.experts = [_experts(router, family) for router, family in known]
        config = getattr(model, "config", None)
        if config is not None and hasattr(config, "get_text_config"):
            config = config.get_text_config()
        self.gates = [hf_gate(r, config) for r in self.routers]
        if spec is not None:
            self._check(spec)
        self.agreement: list[float] = []
        self._routes: RouteTensors | None = None
        self._recorded: Recorded | None = None
        self._agree: list[tuple[int, int]] = []
        self._calls: list[int] = []
        self._pending: list[TokenCheck] = []
        self._compared = 0
        self._want: torch.Tensor | None = None

    def _check(self, spec: RouteSpec) -> None:
        problems = []
        if self.num_layers != spec.num_layers:
            problems.append(f"{self.num_layers} MoE layers (routes: {spec.num_layers})")
        experts = sorted(set(self.experts))
        if experts != [spec.num_experts]:
            problems.append(f"{'/'.join(map(str, experts))} experts (routes: {spec.num_experts})")
        top_k = sorted({int(getattr(r, "top_k", spec.top_k)) for r in self.routers})
        if top_k != [spec.top_k]:
            problems.append(f"top-k {'/'.join(map(str, top_k))} (routes: {spec.top_k})")
        if problems:
            raise ValueError("the model does not match the routes: " + "; ".join(problems))
        for gate in dict.fromkeys(self.gates):
            pairs = zip(self.routers, self.gates, strict=True)
            names = sorted({type(r).__name__ for r, g in pairs if g == gate})
            check_gate(spec.model, gate, f"its {', '.join(names)}")

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def _wrapped(
        self, make: Callable[[int, Callable[..., Any]], Callable[..., Any]]
    ) -> Iterator[None]:
        """Each router's forward replaced by `make(layer, original)` inside the block."""
        originals = [router.forward for router in self.routers]
        for layer, router in enumerate(self.routers):
            router.forward = make(layer, originals[layer])
        try:
            yield
        finally:
            for router in self.routers:
                router.__dict__.pop("forward", None)

    @contextmanager
    def replay(
        self, routes: RouteTensors | CompactRoutes, input_ids: torch.Tensor | None = None
    ) -> Iterator[RouterReplay]:
        """Make every MoE layer run the replayed experts for the forward passes inside
        (compact routes are widened on their device first). With the token check on,
        the `input_ids` each forward is called with (or `input_ids` given here) are
        compared with the routes' stored token ids; a mismatch raises at the end of
        the block (`TokenMismatch`), before any backward that follows it."""
        routes = as_wide(routes)
        if routes.ids.dim() != 4 or routes.ids.shape[2] != self.num_layers:
            raise InvalidRoutes(
                f"routes {tuple(routes.ids.shape)} do not match [B, T, {self.num_layers}, K]: "
                f"the model has {self.num_layers} MoE layers"
            )
        full = routes.valid.all(dim=-1)
        partial = routes.valid.any(dim=-1) & ~full
        if bool(partial.any()):
            b, t, layer = (int(x) for x in partial.nonzero()[0])
            raise InvalidRoutes(
                f"sequence {b}, token {t}, layer {layer} has fewer than K experts: a top-k "
                "router cannot replay it"
            )
        too_big = [
            layer
            for layer, experts in enumerate(self.experts)
            if bool((routes.ids[:, :, layer] >= experts).any())
        ]
        if too_big:
            raise InvalidRoutes(f"routes of layers {too_big} name experts the model does not have")
        checking = self.check_tokens and routes.tokens is not None
        if self.check_tokens:
            warn_untokened(routes.tokens, routes.origin)
        self._routes = routes
        self._agree = [(0, 0)] * self.num_layers
        self._calls = [0] * self.num_layers
        self._pending, self._compared, self._want = [], 0, None
        if checking and input_ids is not None:
            self._compare(input_ids)
        checked = _input_ids_to(self.model, self._compare) if checking else nullcontext()
        try:
            with checked, self._wrapped(self._replaying):
                yield self
            self.verify()
            never = [layer for layer, calls in enumerate(self._calls) if calls == 0]
            if never:
                raise RuntimeError(
                    f"the routers of layers {never} were not called while replaying: something "
                    "(a hub kernel, a custom MoE block) routes around them"
                )
            if checking and not self._compared:
                warn_once(
                    "no-input-ids",
                    routes.origin,
                    "the model was called without input_ids while replaying, so its tokens "
                    "were not checked against the routes' (pass input_ids= to replay())",
                )
        finally:
            self._routes = None
            self._pending = []
            self.agreement = [n / d if d else 1.0 for n, d in self._agree]

    def verify(self) -> None:
        """Raise `TokenMismatch` if a forward of the current block was given other tokens
        than the routes' (the end of `replay` does it)."""
        pending, self._pending = self._pending, []
        for check in pending:
            check.verify()

    def _compare(self, input_ids: torch.Tensor) -> None:
        """Queue the device-side comparison of `input_ids` `[B, T]` with the routes'
        token ids: routers see the batch flattened row-major, so token `t` of row `b` is
        routed with the routes of sequence `b`, token `t`."""
        routes = self._routes
        assert routes is not None
        assert routes.tokens is not None
        want = routes.tokens
        if tuple(input_ids.shape) != tuple(want.shape):
            raise InvalidRoutes(
                f"the input ids are {list(input_ids.shape)}, the routes' stored tokens "
                f"{list(want.shape)}: the routes must be [B, T, L, K] padded to the input's T"
            )
        if self._want is None or self._want.device != input_ids.device:
            # once per block, where the model runs
            self._want = want.reshape(-1).to(input_ids.device, non_blocking=True)
        width = int(want.shape[1])
        self._pending.append(
            TokenCheck(
                self._want,
                input_ids.reshape(-1),
                routes.origin,
                "the batch is padded otherwise (the routes hold each sequence from "
                "position 0: right padding)",
                lambda rows: divmod(rows, width),
            )
        )
        self._compared += 1

    def _replaying(self, layer: int, original: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            routes = self._routes
            assert routes is not None
            k = routes.ids.shape[-1]
            ids = routes.ids[:, :, layer, :].reshape(-1, k).long()
            recorded = routes.valid[:, :, layer, :].reshape(-1, k).all(dim=-1)
            substitution = _Substitution(self.experts[layer], ids, ~recorded)
            with _topk_substituted(substitution):
                out = original(*args, **kwargs)
            router = self.routers[layer]
            if substitution.matches != 1:
                raise RuntimeError(
                    f"{type(router).__name__} (layer {layer}) made {substitution.matches} top-{k} "
                    f"choices over {self.experts[layer]} experts for {ids.shape[0]} tokens, "
                    "not one: its input does not match the routes, or it routes in a way "
                    "replay cannot reproduce"
                )
            assert substitution.chosen is not None
            assert substitution.own is not None
            if not torch.equal(out[2], substitution.chosen):
                raise RuntimeError(
                    f"{type(router).__name__} (layer {layer}) ignored the replayed top-k"
                )
            self._calls[layer] += 1
            agree = int((same_sets(substitution.own, ids) & recorded.to(ids.device)).sum())
            n, d = self._agree[layer]
            self._agree[layer] = (n + agree, d + int(recorded.sum()))
            return out

        return forward

    @contextmanager
    def record(self) -> Iterator[Recorded]:
        """Capture the live routers' choices of the forward pass inside."""
        recorded = self._recorded = Recorded()

        def shape_of(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for value in (*args, kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
                if isinstance(value, torch.Tensor) and value.dim() >= 2:
                    recorded.shape = (int(value.shape[0]), int(value.shape[1]))
                    return

        def recording(layer: int, original: Callable[..., Any]) -> Callable[..., Any]:
            def forward(*args: Any, **kwargs: Any) -> Any:
                out = original(*args, **kwargs)
                recorded.layers.append(out[2].detach().clone())
                return out

            return forward

        handle = self.model.register_forward_pre_hook(shape_of, with_kwargs=True)
        try:
            with self._wrapped(recording):
                yield recorded
        finally:
            handle.remove()
            self._recorded = None
