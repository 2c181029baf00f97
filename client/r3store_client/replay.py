"""Rollout Routing Replay in the trainer (torch required).

The R3 gate: the trainer runs the experts the engine chose, with gate weights computed
from *its own* router logits restricted to those experts, so the router still learns.
Weights come from the full dense logits, gathered at the replayed experts, never from
the live top-k's sparse output (whose zeros would silently kill the gradient of an
expert the trainer's router no longer ranks in its top-k).

`RouterReplay(model)` finds HF transformers MoE routers (Qwen3-MoE, Mixtral, OLMoE: the
`...TopKRouter` modules returning `(logits, weights, indices)`), in layer order, and
hooks them:

    replayer = RouterReplay(model)
    with replayer.replay(routes):          # RouteTensors [B, T, L, K] matching the input
        out = model(input_ids)
    replayer.agreement                     # per layer: live top-k == replayed set
    with replayer.record() as recorded:    # capture the live routes instead
        model(input_ids)
    recorded.ids                           # [B, T, L, K]

Token-layers with no recorded route fall back to the live router; empty slots of a
partial route get weight zero.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from r3store_client.tensors import RouteTensors


def softmax_gate(logits: torch.Tensor, ids: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Qwen/Mixtral/OLMoE-style weights of the replayed experts `ids` `[N, K]`:
    softmax over all experts' logits, gathered at `ids`, renormalised over the k when
    `normalize` (that is, a softmax over the replayed experts' logits)."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights = probs.gather(-1, ids.long())
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return weights


def sigmoid_gate(
    logits: torch.Tensor,
    ids: torch.Tensor,
    normalize: bool = True,
    scaling: float = 1.0,
) -> torch.Tensor:
    """DeepSeek-style weights: sigmoid scores of the replayed experts, normalised over the
    k and scaled by the routed scaling factor. (The selection bias only chooses experts;
    replay chooses them instead, so it plays no part here.)"""
    scores = torch.sigmoid(logits.float()).gather(-1, ids.long())
    if normalize:
        scores = scores / scores.sum(dim=-1, keepdim=True).clamp_min(1e-20)
    return scores * scaling


def is_router(module: nn.Module) -> bool:
    return type(module).__name__.endswith("TopKRouter") and hasattr(module, "top_k")


def same_sets(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`[N]` bool: the rows of `a` and `b` `[N, K]` hold the same experts."""
    return (a.sort(dim=-1).values == b.long().sort(dim=-1).values).all(dim=-1)


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
    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.routers = [m for m in model.modules() if is_router(m)]
        if not self.routers:
            raise ValueError("no MoE routers (`...TopKRouter` modules) found in the model")
        self.agreement: list[float] = []
        self._routes: RouteTensors | None = None
        self._recorded: Recorded | None = None
        self._agree: list[tuple[int, int]] = []

    @property
    def num_layers(self) -> int:
        return len(self.routers)

    @contextmanager
    def _hooked(self) -> Iterator[None]:
        handles = [
            router.register_forward_hook(self._hook(layer))
            for layer, router in enumerate(self.routers)
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    @contextmanager
    def replay(self, routes: RouteTensors) -> Iterator[RouterReplay]:
        """Make every MoE layer run the replayed experts for the forward passes inside."""
        if routes.ids.dim() != 4 or routes.ids.shape[2] != self.num_layers:
            raise ValueError(
                f"routes {tuple(routes.ids.shape)} do not match [B, T, {self.num_layers}, K]"
            )
        self._routes = routes
        self._agree = [(0, 0)] * self.num_layers
        try:
            with self._hooked():
                yield self
        finally:
            self._routes = None
            self.agreement = [n / d if d else 1.0 for n, d in self._agree]

    @contextmanager
    def record(self) -> Iterator[Recorded]:
        """Capture the live routers' choices of the forward pass inside."""
        recorded = self._recorded = Recorded()

        def shape_of(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            for value in (*args, kwargs.get("input_ids"), kwargs.get("inputs_embeds")):
                if isinstance(value, torch.Tensor) and value.dim() >= 2:
                    recorded.shape = (int(value.shape[0]), int(value.shape[1]))
                    return

        handle = self.model.register_forward_pre_hook(shape_of, with_kwargs=True)
        try:
            with self._hooked():
                yield recorded
        finally:
            handle.remove()
            self._recorded = None

    def _hook(self, layer: int) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            logits, weights, live = output
            if self._recorded is not None:
                self._recorded.layers.append(live.detach().clone())
                return output
            if self._routes is None:
                return output
            ids = self._routes.ids[:, :, layer, :].reshape(-1, live.shape[-1]).to(live.device)
            valid = self._routes.valid[:, :, layer, :].reshape(-1, live.shape[-1]).to(live.device)
            if ids.shape[0] != live.shape[0]:
                raise ValueError(
                    f"layer {layer}: routes cover {ids.shape[0]} tokens, "
                    f"the input has {live.shape[0]}"
                )
            recorded = valid.any(dim=-1)  # token-layers with a route; others stay live
            normalize = bool(getattr(module, "norm_topk_prob", True))
            replayed = softmax_gate(logits, ids, normalize).to(weights.dtype)
            replayed = replayed * valid.to(replayed.dtype)
            full = valid.all(dim=-1)
            agree = int((same_sets(live, ids) & full).sum())
            n, d = self._agree[layer]
            self._agree[layer] = (n + agree, d + int(full.sum()))
            keep = recorded.unsqueeze(-1)
            out_ids = torch.where(keep, ids.to(live.dtype), live)
            out_weights = torch.where(keep, replayed, weights)
            return logits, out_weights, out_ids

        return hook
