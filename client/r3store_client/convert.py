"""From what inference engines emit to `TrajectoryWrite`s, without torch.

- SGLang (`return_routed_experts=True`): `meta_info["routed_experts"]`, base64 of
  little-endian int32 `[rows, L, K]`, covering tokens `[routed_experts_start_len,
  seqlen - 1)`: the last sampled token is never routed. A later turn asked with
  `routed_experts_start_len` equal to the stored length appends a segment.
- vLLM: `routed_experts` as a uint8 or uint16 numpy array `[T - 1, L, K]`.
- HF transformers routers: per MoE layer, top-k ids `[T, K]` (a list of arrays or tensors).
- Plain top-k id arrays (numpy, or torch via `.numpy()`) and bit-packed masks.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3store.errors import InvalidRoutes
from r3store.records import TrajectoryWrite


def _numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array or a (CPU or GPU) torch tensor."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def sglang_routes(
    meta_info: Mapping[str, Any], num_layers: int, top_k: int
) -> tuple[np.ndarray, int]:
    """`(ids [rows, L, K] int32, start)` from an SGLang response's `meta_info`."""
    encoded = meta_info.get("routed_experts")
    if not isinstance(encoded, str):
        raise InvalidRoutes(
            "meta_info has no base64 'routed_experts' (was return_routed_experts set?)"
        )
    try:
        raw = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidRoutes(f"routed_experts is not base64: {exc}") from None
    width = num_layers * top_k * 4
    if len(raw) % width:
        raise InvalidRoutes(
            f"routed_experts holds {len(raw)} bytes: "
            f"not whole rows of [{num_layers}, {top_k}] int32"
        )
    ids = np.frombuffer(raw, dtype="<i4").reshape(-1, num_layers, top_k)
    return ids, int(meta_info.get("routed_experts_start_len") or 0)


def from_sglang(
    trajectory_id: str,
    meta_info: Mapping[str, Any],
    total_tokens: int,
    num_layers: int,
    top_k: int,
    **meta: Any,
) -> TrajectoryWrite:
    """A write (or, with `routed_experts_start_len`, an appended segment) from SGLang.

    `total_tokens` is the sequence length, prompt and output together.
    """
    ids, start = sglang_routes(meta_info, num_layers, top_k)
    num_tokens = total_tokens - start
    if ids.shape[0] not in (num_tokens, num_tokens - 1):
        raise InvalidRoutes(
            f"SGLang sent {ids.shape[0]} rows for tokens [{start}, {total_tokens}); "
            f"expected {num_tokens - 1}"
        )
    return TrajectoryWrite(trajectory_id, num_tokens, topk=ids, start=start, **meta)


def from_vllm(
    trajectory_id: str, routed_experts: Any, num_tokens: int, **meta: Any
) -> TrajectoryWrite:
    """A write from vLLM's `routed_experts` array (uint8 or uint16 `[T - 1, L, K]`)."""
    ids = _numpy(routed_experts)
    if ids.dtype not in (np.uint8, np.uint16, np.int32, np.int64) or ids.ndim != 3:
        raise InvalidRoutes(
            f"vLLM routed_experts must be [T-1, L, K] uint8/uint16, got {ids.dtype} {ids.shape}"
        )
    return TrajectoryWrite(trajectory_id, num_tokens, topk=ids, **meta)


def from_hf_router(
    trajectory_id: str, layer_topk: Sequence[Any], num_tokens: int | None = None, **meta: Any
) -> TrajectoryWrite:
    """A write from per-layer top-k ids `[T, K]` as HF transformers' routers return them."""
    if not layer_topk:
        raise InvalidRoutes("no layers given")
    layers = [_numpy(x) for x in layer_topk]
    if len({x.shape for x in layers}) != 1 or layers[0].ndim != 2:
        raise InvalidRoutes("every layer's top-k ids must have the same [T, K] shape")
    ids = np.stack(layers, axis=1)  # [T, L, K]
    return TrajectoryWrite(trajectory_id, num_tokens or ids.shape[0], topk=ids, **meta)


def from_topk(trajectory_id: str, ids: Any, num_tokens: int, **meta: Any) -> TrajectoryWrite:
    """A write from plain top-k ids `[rows, L, K]` (numpy or torch); -1 marks empty slots."""
    return TrajectoryWrite(trajectory_id, num_tokens, topk=_numpy(ids), **meta)


def from_mask(trajectory_id: str, mask: Any, num_tokens: int, **meta: Any) -> TrajectoryWrite:
    """A write from bit-packed masks `[rows, L, ceil(E/8)]` uint8 (numpy or torch)."""
    return TrajectoryWrite(trajectory_id, num_tokens, mask=_numpy(mask), **meta)
