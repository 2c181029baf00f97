"""r3store's routes as one rank's Megatron-Core routers take them, and the token check
(torch required).

`layer_indices` gives each MoE layer's `[N, K]` expert ids in the order a
`TokenLayout` names (`megatron_layout`), `-1` rows where no route was recorded (padding
included): Megatron's replay falls back to the live router for exactly those rows,
never replaying them as expert 0. Whether a layer has such rows is noted on its tensor
when it is loaded (`noted`, `live_rows`), so that no layer waits on the device.
`gather_recorded` is the inverse, for what the routers recorded.

Routes that carry the token ids stored with them are checked against the input ids the
model is called with, in the order this rank's routers see them (`router_tokens`), on
the device: `ExpectedTokens` holds the stored token of each router row, `check_tokens`
makes the check on its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidRoutes
from r3store.spec import RouteSpec
from r3store_client.megatron_layout import TokenLayout, check_parallel, seen_by_routers
from r3store_client.tensors import CompactRoutes, Origin, RouteTensors, as_wide
from r3store_client.token_check import TokenCheck

_LIVE = "_r3_live"  # the note on a layer's tensor: whether it has rows for the live router


def noted(data: torch.Tensor, live: bool | None) -> torch.Tensor:
    """`data` noting whether it has rows for the live router (None: not known)."""
    data.__dict__[_LIVE] = live
    return data


def live_rows(data: torch.Tensor) -> bool | None:
    """What `noted` noted on `data`: whether it has rows for the live router."""
    live: bool | None = data.__dict__.get(_LIVE)
    return live


def layer_indices(
    routes: RouteTensors | CompactRoutes, layout: TokenLayout, layers: Sequence[int]
) -> list[torch.Tensor]:
    """Per MoE layer in `layers` (indices into the routes' layer axis), the `[N, K]`
    int64 expert ids of the tokens `layout` names, in its order; `-1` rows where no
    route was recorded (or for padding). A token-layer with fewer than K experts cannot
    be replayed by Megatron's top-k and is refused."""
    return replay_data(as_wide(routes), layout, layers)[0]


def replay_data(
    routes: RouteTensors, layout: TokenLayout, layers: Sequence[int], tokens: bool = False
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """`layer_indices`, on the routes' device, with (if `tokens`) the stored token of
    each router row (-1: padding, or none stored) from the same gather; the host reads
    one small tensor (partial rows, and the layers with rows for the live router)."""
    if routes.ids.dim() != 4:
        raise InvalidRoutes("Megatron replay takes padded routes [B, T, L, K]")
    line_up(routes, layout)
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
        out.append(noted(data, flags[1 + layer]))
    want = None
    if tokens and routes.tokens is not None:
        if routes.tokens.dim() != 2:
            raise InvalidRoutes("the token check takes padded routes' tokens [B, T]")
        stored = routes.tokens.to(device, non_blocking=True)
        want = torch.where(real, stored[seq, tok.clamp(max=max(stored.shape[1] - 1, 0))], -1)
    return out, want


def line_up(routes: RouteTensors | CompactRoutes, layout: TokenLayout) -> None:
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


@dataclass(frozen=True)
class ExpectedTokens:
    """The stored token of each of this rank's router rows (-1: padding, or none
    stored), made once per micro-batch."""

    want: torch.Tensor
    origin: Origin
    layout: TokenLayout

    def compare(self, input_ids: torch.Tensor) -> TokenCheck:
        got = seen_by_routers(input_ids, self.layout.parallel)
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


def _expected_tokens(
    tokens: torch.Tensor | None, layout: TokenLayout, origin: Origin
) -> ExpectedTokens | None:
    """The stored token of each router row of `layout`, from the routes' `tokens`
    `[B, T]`, on their device."""
    if tokens is None:
        return None
    if tokens.dim() != 2:
        raise InvalidRoutes("the token check takes padded routes' tokens [B, T]")
    sequence = layout.sequence.to(tokens.device, non_blocking=True)
    index = sequence * tokens.shape[1] + layout.token.to(tokens.device, non_blocking=True)
    want = torch.where(sequence >= 0, tokens.reshape(-1)[index.clamp(min=0)], -1)
    return ExpectedTokens(want, origin, layout)


def check_tokens(
    routes: RouteTensors | CompactRoutes, layout: TokenLayout, input_ids: torch.Tensor
) -> TokenCheck | None:
    """The token check `MegatronReplay` makes, on its own: `input_ids` as this rank's
    model is called with them, against the routes' stored tokens in the layout's
    order. `verify()` on the result raises `TokenMismatch`; None when the routes carry
    no token ids. A layout of another rank than this process is refused
    (`check_parallel`)."""
    check_parallel(layout.parallel)
    line_up(routes, layout)
    expected = _expected_tokens(routes.tokens, layout, routes.origin)
    return None if expected is None else expected.compare(input_ids)


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
