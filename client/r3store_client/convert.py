"""From what inference engines emit to `TrajectoryWrite`s, without torch.

Checked against the engines' sources (SGLang 0.5.23; vLLM 0.33.0, commit 4ba787ec9):

- SGLang (`return_routed_experts=True`): `meta_info["routed_experts"]` is base64 of the
  raw little-endian int32 bytes of `[rows, num_hidden_layers, top_k]`
  (`srt/managers/detokenizer_manager.py`, `_b64_encode_per_request`). The rows cover
  tokens `[routed_experts_start_len, seqlen - 1)`: the prompt is included, the last
  sampled token never ran a forward pass (`srt/state_capturer/base.py`, `get_topk`).
  `routed_experts_start_len` is a request field (`srt/managers/io_struct.py`) that the
  response does not echo: pass it as `start`.
- vLLM (`enable_return_routed_experts`): `CompletionOutput.routed_experts`, a numpy array
  `[num_tokens - 1 - routed_experts_prompt_start, total_num_hidden_layers, top_k]`,
  uint8 for up to 256 experts, else uint16 (`fused_moe/routed_experts_capturer.py`);
  builds differ (int32 transit buffers, int16 sinks), so any integer dtype is taken,
  its values checked as sent. The OpenAI server sends it as base64 of an `.npy` file.
- Both engines emit every decoder layer, dense ones as rows of zeros (indistinguishable
  from expert 0), and logical expert ids (before EPLB remapping). A namespace holds the
  MoE layers only: pass `moe_layers`, the engine layers that are MoE; a dense layer
  left in is refused, never stored as expert 0.
- HF transformers routers: per MoE layer, top-k ids `[T, K]` (a list of arrays or tensors).
- Plain top-k id arrays (numpy, or torch via `.numpy()`) and bit-packed masks.

Slot order (`TrajectoryWrite.slot_order`; docs/replay.md, "Slot order"): neither engine
promises one. Their captured ids are whatever top-k the router ran left them in: a
kernel that picks the best expert K times (rank order) on some GPU paths, `torch.topk(...,
sorted=False)` on others and on the CPU (vLLM 0.32 `router/cpu_router.py`,
`grouped_topk_router.py`; SGLang `layers/moe/topk.py`), captured before any sort. So
`from_vllm` and `from_sglang` state `"set"` (an ordered namespace refuses them) unless
given `slot_order="verbatim"`: the slots kept as the engine left them, knowing they are no
rank order. `from_hf_router` states `"rank"` for a router family whose final top-k is
sorted (`hf_routers.Family.ranked`), else `"set"`; plain ids and masks `"rank"`, the
caller's word.
"""

from __future__ import annotations

import base64
import binascii
import io
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3store.errors import InvalidInput, InvalidRoutes
from r3store.records import RANK, SET, VERBATIM, SlotOrder, TrajectoryWrite
from r3store_client.hf_routers import FAMILIES


def _numpy(x: Any) -> np.ndarray:
    """numpy view of a numpy array or a (CPU or GPU) torch tensor."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def moe_only(ids: np.ndarray, moe_layers: Sequence[int] | None) -> np.ndarray:
    """`[rows, layers, K]` engine routes with only the MoE layers kept (all if None).

    A layer whose every row is all zeros is a dense layer (engines leave those rows
    zero): with K > 1 zeros cannot be a real route, so keeping one is refused.
    """
    if moe_layers is not None:
        layers = list(moe_layers)
        bad = [i for i in layers if not 0 <= i < ids.shape[1]]
        if bad:
            raise InvalidRoutes(
                f"moe_layers {bad} are not among the engine's {ids.shape[1]} layers"
            )
        ids = ids[:, layers]
    if ids.shape[0] and ids.shape[2] > 1:
        zero = np.flatnonzero(~ids.reshape(ids.shape[0], ids.shape[1], -1).any(axis=(0, 2)))
        if zero.size:
            raise InvalidRoutes(
                f"layer {int(zero[0])} is all zeros: a dense layer, which engines fill with "
                "zeros; pass moe_layers (the engine layers that are MoE)"
            )
    return ids


def _engine_order(engine: str, slot_order: SlotOrder) -> SlotOrder:
    """An engine's captured routes promise no order: `"set"`, or `"verbatim"` when the
    caller keeps the slots as given; `"rank"` is refused."""
    if slot_order not in (SET, VERBATIM):
        raise InvalidInput(
            f"{engine} promises no rank order of the top-k slots (its router's top-k is not "
            "always sorted by score, and it captures the ids unsorted): slot_order must be "
            f"'set' or 'verbatim', not {slot_order!r}"
        )
    return slot_order


def _segment(
    trajectory_id: str,
    ids: np.ndarray,
    total_tokens: int,
    start: int,
    engine: str,
    slot_order: SlotOrder,
    **meta: Any,
) -> TrajectoryWrite:
    order = _engine_order(engine, slot_order)
    num_tokens = total_tokens - start
    if start < 0 or num_tokens < 1:
        raise InvalidRoutes(f"start {start} is not inside the {total_tokens} tokens")
    if ids.shape[0] not in (num_tokens, num_tokens - 1):
        raise InvalidRoutes(
            f"{engine} sent {ids.shape[0]} rows for tokens [{start}, {total_tokens}); "
            f"expected {num_tokens - 1} (was the start given?)"
        )
    return TrajectoryWrite(
        trajectory_id,
        num_tokens,
        topk=ids,
        start=start,
        slot_order=order,
        producer=engine,
        **meta,
    )


def sglang_routes(
    meta_info: Mapping[str, Any], num_layers: int, top_k: int
) -> tuple[np.ndarray, int]:
    """`(ids [rows, num_layers, K] int32, start)` from an SGLang response's `meta_info`
    (`num_layers`: the model's `num_hidden_layers`, dense ones included; `start`: the
    echoed `routed_experts_start_len` if any, else 0)."""
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
    *,
    start: int | None = None,
    moe_layers: Sequence[int] | None = None,
    slot_order: SlotOrder = SET,
    **meta: Any,
) -> TrajectoryWrite:
    """A write (or, from `start > 0`, an appended segment) from an SGLang response.

    `total_tokens` is the sequence length, prompt and output together; `num_layers`
    the model's `num_hidden_layers`; `start` the `routed_experts_start_len` the request
    asked for (SGLang does not echo it); `moe_layers` the MoE layers to keep;
    `slot_order` `"set"` (SGLang promises no order: an ordered namespace refuses it) or
    `"verbatim"` (keep SGLang's slots as given).
    """
    ids, echoed = sglang_routes(meta_info, num_layers, top_k)
    return _segment(
        trajectory_id,
        moe_only(ids, moe_layers),
        total_tokens,
        echoed if start is None else start,
        "SGLang",
        slot_order,
        **meta,
    )


def vllm_routes(routed_experts: Any) -> np.ndarray:
    """vLLM's `routed_experts` as an array: a numpy array (the Python API) or the OpenAI
    server's base64 of an `.npy` file; any integer dtype, `[rows, layers, K]`."""
    if isinstance(routed_experts, str):
        try:
            ids: np.ndarray = np.load(
                io.BytesIO(base64.b64decode(routed_experts, validate=True)), allow_pickle=False
            )
        except (binascii.Error, ValueError, OSError) as exc:
            raise InvalidRoutes(f"routed_experts is not base64 of an .npy array: {exc}") from None
    else:
        ids = _numpy(routed_experts)
    if ids.dtype.kind not in "iu" or ids.ndim != 3:
        raise InvalidRoutes(
            f"vLLM routed_experts must be [rows, layers, K] integers, got {ids.dtype} "
            f"{list(ids.shape)}"
        )
    return ids


def from_vllm(
    trajectory_id: str,
    routed_experts: Any,
    num_tokens: int,
    *,
    prompt_start: int = 0,
    moe_layers: Sequence[int] | None = None,
    slot_order: SlotOrder = SET,
    **meta: Any,
) -> TrajectoryWrite:
    """A write (or, from `prompt_start > 0`, an appended segment) from vLLM.

    `num_tokens` is the sequence length, prompt and output together; `prompt_start` the
    request's `routed_experts_prompt_start`; `moe_layers` the MoE layers to keep;
    `slot_order` `"set"` (vLLM promises no order: an ordered namespace refuses it) or
    `"verbatim"` (keep vLLM's slots as given).
    """
    ids = moe_only(vllm_routes(routed_experts), moe_layers)
    return _segment(trajectory_id, ids, num_tokens, prompt_start, "vLLM", slot_order, **meta)


def hf_router_name(router: Any) -> str:
    """The class name of an HF router given as a module, a class or a name."""
    if isinstance(router, str):
        return router
    return router.__name__ if isinstance(router, type) else type(router).__name__


def from_hf_router(
    trajectory_id: str,
    layer_topk: Sequence[Any],
    num_tokens: int | None = None,
    *,
    router: Any = None,
    **meta: Any,
) -> TrajectoryWrite:
    """A write from per-layer top-k ids `[T, K]` as HF transformers' routers return them.

    `router` (a router module, its class or class name) says whose ids they are: a
    family whose final top-k is sorted by score (`hf_routers.Family.ranked`: Qwen,
    Mixtral, OLMoE, ...) gives them in rank order (`slot_order="rank"`); any other
    (DeepSeek-V3 and its siblings take `sorted=False`), or none named, promises no order
    (`"set"`: an ordered namespace refuses it). `slot_order="verbatim"` keeps the slots
    as they came, whatever the router.
    """
    if not layer_topk:
        raise InvalidRoutes("no layers given")
    layers = [_numpy(x) for x in layer_topk]
    if len({x.shape for x in layers}) != 1 or layers[0].ndim != 2:
        raise InvalidRoutes("every layer's top-k ids must have the same [T, K] shape")
    ids = np.stack(layers, axis=1)  # [T, L, K]
    if router is None:
        name, ranked = "an HF router not named (pass router= to from_hf_router)", False
    else:
        name = hf_router_name(router)
        family = FAMILIES.get(name)
        ranked = family is not None and family.ranked
    meta.setdefault("slot_order", RANK if ranked else SET)
    meta.setdefault("producer", name)
    return TrajectoryWrite(trajectory_id, num_tokens or ids.shape[0], topk=ids, **meta)


def from_topk(trajectory_id: str, ids: Any, num_tokens: int, **meta: Any) -> TrajectoryWrite:
    """A write from plain top-k ids `[rows, L, K]` (numpy or torch); -1 marks empty slots."""
    return TrajectoryWrite(trajectory_id, num_tokens, topk=_numpy(ids), **meta)


def from_mask(trajectory_id: str, mask: Any, num_tokens: int, **meta: Any) -> TrajectoryWrite:
    """A write from bit-packed masks `[rows, L, ceil(E/8)]` uint8 (numpy or torch)."""
    return TrajectoryWrite(trajectory_id, num_tokens, mask=_numpy(mask), **meta)
