"""verl (volcengine/verl 0.9): route refs in verl's batches instead of the routes (torch
required; verl and tensordict are imported only by the calls that take their objects).

verl's R3 (`rollout.enable_rollout_routing_replay=True`, `router_replay.mode=R3`) sends
the engine's routes from the agent loop to the trainer inside the batch: the agent loop
worker (`AgentLoopWorker._agent_loop_postprocess`) casts each trajectory's routes to
int16 and places them in a `(1, prompt_length + response_length, L, K)` tensor at the
sample's token positions (prompts left-padded, responses right-padded, so a sample's
tokens are one run of `attention_mask`; rows the engine did not record, its last
token's and any tool tokens after its last turn, stay zero), and `_postprocess` stacks
them into `batch["routed_experts"]` `(bs, seq, L, K)`. On the trainer the driver turns
the batch into a no-padding TensorDict (`left_right_2_no_padding`: the routes become a
jagged `(bs, j, L, K)` tensor over each sample's tokens), chunks it across the
data-parallel ranks, and each rank's Megatron engine replays it
(`align_r3_router_replay_data`, `build_r3_replay_mask`, `set_router_replay_data`).

Here the routes go to r3store instead and the batch carries a ref per sample:

    # rollout side, on the DataProto an agent loop worker returns
    refs = store_routes(batch, client, "run1", policy_version=step)
    # (or `await store_routes_async(batch, async_client, ...)` in its coroutine)
    # batch.batch has no "routed_experts" now; batch.non_tensor_batch["routed_experts_ref"]
    # holds each sample's ref as JSON (a few hundred bytes), and travels with the batch

    # trainer side, either on a padded DataProto (the dense tensor verl would have built)
    resolve_routes(batch, client)          # batch.batch["routed_experts"] (bs, seq, L, K)
    # or per data-parallel rank, on the no-padding TensorDict shard the rank receives
    resolve_nested(shard, client)          # shard["routed_experts"]: jagged, as
                                           # left_right_2_no_padding makes it

Each sample's stored trajectory is its real tokens (`attention_mask`'s run) with their
token ids, so resolution checks that the batch holds the tokens the routes were
recorded for (`TokenMismatch` names the trajectory and token otherwise). In a namespace
whose spec keeps the engine's top-k order (`RouteSpec(..., ordered=True)`) the resolved
tensor equals verl's own bit for bit; an unordered one gives each token-layer's experts
sorted (the same routing: verl's replay gathers and scatters by expert). The writes keep
the slots as verl holds them (`slot_order="verbatim"`): the engine's slot order, which
for vLLM and SGLang is no rank order. A token-layer
whose K slots are all zero is verl's "no route" padding (K > 1): it is stored as no
route and resolves to zeros again.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidInput
from r3store.policy import ENGINE, Source
from r3store.records import VERBATIM, PutResult, TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client.tensors import CompactRoutes, compact
from r3store_client.token_check import TokenMismatch

if TYPE_CHECKING:
    from r3store_client.aio import AsyncClient
    from r3store_client.client import Client

__all__ = [
    "REFS_KEY",
    "ROUTES_KEY",
    "Placed",
    "placement",
    "refs_of",
    "resolve_nested",
    "resolve_routes",
    "route_writes",
    "store_routes",
    "store_routes_async",
]

ROUTES_KEY = "routed_experts"  # verl's own key, in the batch's tensors
REFS_KEY = "routed_experts_ref"  # the refs, in the batch's non-tensor data (JSON strings)
PUT_CHUNK = 64  # trajectories per upload


@dataclass(frozen=True)
class Placed:
    """Where sample `index`'s tokens lie in verl's padded row: `first ..< first + n`,
    `prompt_len` of them the prompt's."""

    index: int
    first: int
    num_tokens: int
    prompt_len: int


def _tensors(data: Any) -> Any:
    """The tensors of a `DataProto` (its `batch`) or a `TensorDict`."""
    batch = getattr(data, "batch", None)
    return data if batch is None else batch


def placement(attention_mask: torch.Tensor, prompt_width: int) -> list[Placed]:
    """Each sample's run of real tokens in verl's left/right-padded layout; ValueError
    for a sample without tokens or whose tokens are not one run (not verl's layout)."""
    mask = attention_mask.detach().cpu().to(torch.bool)
    if mask.dim() != 2:
        raise ValueError(f"attention_mask must be [bs, seq], got {list(mask.shape)}")
    out = []
    for i, row in enumerate(mask):
        where = torch.nonzero(row).flatten()
        if where.numel() == 0:
            raise ValueError(f"sample {i} has no tokens (its attention_mask is all zero)")
        first, last = int(where[0]), int(where[-1])
        if where.numel() != last - first + 1:
            raise ValueError(
                f"sample {i}: its attention_mask is not one run of tokens (verl left-pads "
                "prompts and right-pads responses)"
            )
        prompt_len = int(row[:prompt_width].sum())
        out.append(Placed(i, first, last - first + 1, prompt_len))
    return out


def _default_ids(data: Any, count: int) -> tuple[list[str], list[str | None]]:
    """Trajectory ids `<uid>/<n>` (the n-th sample of GRPO group `uid`) and the groups,
    from verl's `uid` column."""
    non_tensor = getattr(data, "non_tensor_batch", None) or {}
    if "uid" not in non_tensor:
        raise ValueError(
            "the batch has no 'uid' column to name its trajectories by: pass trajectory_ids"
        )
    uids = [str(u) for u in non_tensor["uid"]]
    if len(uids) != count:
        raise ValueError(f"'uid' has {len(uids)} entries for {count} samples")
    seen: Counter[str] = Counter()
    ids = []
    for uid in uids:
        ids.append(f"{uid}/{seen[uid]}")
        seen[uid] += 1
    groups: list[str | None] = list(uids)
    return ids, groups


def route_writes(
    data: Any,
    *,
    policy_version: int,
    trajectory_ids: Sequence[str] | None = None,
    group_ids: Sequence[str | None] | None = None,
    source: Source = ENGINE,
) -> list[TrajectoryWrite]:
    """One `TrajectoryWrite` per sample of a verl batch holding `routed_experts` (a
    `DataProto` as `AgentLoopWorker` returns it, or its `TensorDict`): the sample's real
    tokens with their token ids and routes, unpadded. Trajectory ids default to
    `<uid>/<n>` from verl's `uid` column (the group id then is the uid)."""
    tensors = _tensors(data)
    for key in (ROUTES_KEY, "input_ids", "attention_mask", "prompts"):
        if key not in tensors:
            raise KeyError(f"the batch has no {key!r}: is rollout routing replay on?")
    routes: torch.Tensor = tensors[ROUTES_KEY]
    input_ids: torch.Tensor = tensors["input_ids"]
    attention_mask: torch.Tensor = tensors["attention_mask"]
    if routes.dim() != 4 or routes.shape[:2] != input_ids.shape[:2]:
        raise ValueError(
            f"{ROUTES_KEY} must be [bs, seq, L, K] over input_ids {list(input_ids.shape)}, "
            f"got {list(routes.shape)}"
        )
    placed = placement(attention_mask, int(tensors["prompts"].shape[1]))
    if trajectory_ids is None:
        trajectory_ids, default_groups = _default_ids(data, len(placed))
        group_ids = default_groups if group_ids is None else group_ids
    if len(trajectory_ids) != len(placed):
        raise ValueError(f"{len(trajectory_ids)} trajectory ids for {len(placed)} samples")
    if group_ids is not None and len(group_ids) != len(placed):
        raise ValueError(f"{len(group_ids)} group ids for {len(placed)} samples")
    k = int(routes.shape[-1])
    routes_np = routes.detach().cpu().numpy()
    tokens_np = input_ids.detach().cpu().numpy()
    writes = []
    for p in placed:
        row = routes_np[p.index]
        inside = slice(p.first, p.first + p.num_tokens)
        outside = np.ones(row.shape[0], dtype=bool)
        outside[inside] = False
        if row[outside].any():
            raise ValueError(
                f"sample {p.index} ({trajectory_ids[p.index]!r}) has routes on padding "
                "positions, which a trajectory cannot hold"
            )
        ids = row[inside].astype(np.int32)
        if k > 1:  # verl's zero rows: no recorded route (K zeros are no top-k choice)
            ids[(ids == 0).all(axis=-1)] = -1
        writes.append(
            TrajectoryWrite(
                trajectory_ids[p.index],
                num_tokens=p.num_tokens,
                topk=ids,
                prompt_len=p.prompt_len,
                group_id=None if group_ids is None else group_ids[p.index],
                policy_version=policy_version,
                token_ids=tokens_np[p.index, inside].astype(np.int32),
                source=source,
                slot_order=VERBATIM,  # the engine's slots as verl holds them
                producer="verl",
            )
        )
    return writes


def store_routes(
    data: Any,
    client: Client,
    namespace: str,
    *,
    policy_version: int,
    trajectory_ids: Sequence[str] | None = None,
    group_ids: Sequence[str | None] | None = None,
    source: Source = ENGINE,
    keep_routes: bool = False,
    chunk: int = PUT_CHUNK,
) -> list[RouteRef]:
    """Store each sample's routes of a verl `DataProto` (`route_writes`) in `namespace`
    and put their refs in its `non_tensor_batch[REFS_KEY]` (an object array of JSON
    strings, which DataProto's split, concat, reorder and `to_tensordict` carry along);
    `batch["routed_experts"]` is removed unless `keep_routes`. Returns the refs, in
    batch order, once the server has acknowledged every trajectory durably."""
    writes = _writes(data, policy_version, trajectory_ids, group_ids, source)
    refs: list[RouteRef] = []
    for part in _chunks(writes, chunk):
        refs += _acknowledged(part, client.put(namespace, part))
    _swap(data, refs, keep_routes)
    return refs


async def store_routes_async(
    data: Any,
    client: AsyncClient,
    namespace: str,
    *,
    policy_version: int,
    trajectory_ids: Sequence[str] | None = None,
    group_ids: Sequence[str | None] | None = None,
    source: Source = ENGINE,
    keep_routes: bool = False,
    chunk: int = PUT_CHUNK,
) -> list[RouteRef]:
    """`store_routes` with the asyncio client, for verl's asynchronous agent loop
    workers (`AgentLoopWorker.generate_sequences` is a coroutine): the uploads are
    awaited in turn, and the routes are encoded off the event loop."""
    writes = _writes(data, policy_version, trajectory_ids, group_ids, source)
    refs: list[RouteRef] = []
    for part in _chunks(writes, chunk):
        refs += _acknowledged(part, await client.put(namespace, part))
    _swap(data, refs, keep_routes)
    return refs


def _writes(
    data: Any,
    policy_version: int,
    trajectory_ids: Sequence[str] | None,
    group_ids: Sequence[str | None] | None,
    source: Source,
) -> list[TrajectoryWrite]:
    if not hasattr(data, "non_tensor_batch"):
        raise TypeError(f"store_routes takes a verl DataProto, got {type(data).__name__}")
    return route_writes(
        data,
        policy_version=policy_version,
        trajectory_ids=trajectory_ids,
        group_ids=group_ids,
        source=source,
    )


def _chunks(writes: list[TrajectoryWrite], size: int) -> list[list[TrajectoryWrite]]:
    size = max(1, size)
    return [writes[i : i + size] for i in range(0, len(writes), size)]


def _acknowledged(part: list[TrajectoryWrite], results: Sequence[PutResult]) -> list[RouteRef]:
    refs = []
    for write, result in zip(part, results, strict=True):
        if result.trajectory_id != write.trajectory_id or not isinstance(result.ref, RouteRef):
            raise RuntimeError(f"the upload of {write.trajectory_id!r} was not acknowledged")
        refs.append(result.ref)
    return refs


def _swap(data: Any, refs: list[RouteRef], keep_routes: bool) -> None:
    column = np.empty(len(refs), dtype=object)
    column[:] = [ref.to_json() for ref in refs]
    data.non_tensor_batch[REFS_KEY] = column
    if not keep_routes:
        data.batch.pop(ROUTES_KEY)


def refs_of(data: Any) -> list[RouteRef]:
    """The refs a verl batch carries: a `DataProto`'s `non_tensor_batch[REFS_KEY]`, or
    the same column in a `TensorDict` (after `DataProto.to_tensordict`, and in each
    rank's chunk of it)."""
    non_tensor = getattr(data, "non_tensor_batch", None)
    if non_tensor is not None:
        if REFS_KEY not in non_tensor:
            raise KeyError(f"the batch carries no route refs ({REFS_KEY!r}): see store_routes")
        column: Any = non_tensor[REFS_KEY]
    else:
        if REFS_KEY not in data:
            raise KeyError(f"the batch carries no route refs ({REFS_KEY!r}): see store_routes")
        column = data[REFS_KEY]
        column = column.tolist() if hasattr(column, "tolist") else list(column)
    return [ref if isinstance(ref, RouteRef) else RouteRef.from_json(str(ref)) for ref in column]


def _fetch(
    client: Client, refs: Sequence[RouteRef], direct: bool, dtype: torch.dtype
) -> tuple[RouteSpec, CompactRoutes]:
    """The refs' routes, padded and token-major, their ids in `dtype` (`InvalidInput`
    when it cannot hold every expert id of the namespace)."""
    for ref in refs:
        if ref.start != 0:
            raise InvalidInput(f"{ref} starts at token {ref.start}: name whole trajectories")
    spec, batch = client.resolve(refs, direct=direct)
    namespace = refs[0].namespace
    routes = compact(
        batch,
        spec,
        "padded",
        major="token",
        executor=client.decoders,
        namespace=namespace,
        dtype=dtype,
    )
    return spec, routes


def _check_tokens(
    routes: CompactRoutes, b: int, want_n: int, got: torch.Tensor, ref: RouteRef, where: str
) -> None:
    if int(routes.lengths[b]) != want_n:
        raise TokenMismatch(
            f"{ref} holds {int(routes.lengths[b])} tokens but {where} has {want_n}: the "
            "batch's samples are not the refs' (in another order?)"
        )
    if routes.tokens is None:
        return
    stored = routes.tokens[b, :want_n]
    got = got.detach().cpu().to(torch.int32)
    differs = torch.nonzero((stored >= 0) & (stored != got)).flatten()
    if differs.numel():
        t = int(differs[0])
        raise TokenMismatch(
            f"{ref}: token {t} of {where} is {int(got[t])} in the batch but "
            f"{int(stored[t])} in the stored routes: the batch's samples are not the refs' "
            "(in another order?)"
        )


def resolve_routes(
    data: Any,
    client: Client,
    *,
    check_tokens: bool = True,
    direct: bool = False,
    dtype: torch.dtype = torch.int16,
) -> torch.Tensor:
    """Resolve the refs of a padded verl batch (a `DataProto`, or its `TensorDict`) into
    `routed_experts` `(bs, seq, L, K)` as verl's agent loop builds it (int16, each
    sample's routes at its tokens, zeros elsewhere), set it in the batch and return it.
    `check_tokens`: the batch's `input_ids` must be the tokens stored with the routes
    (`TokenMismatch`); a ref that no longer names its routes raises `RefMismatch`, a
    `dtype` that cannot hold every expert id of the namespace `InvalidInput`."""
    refs = refs_of(data)
    tensors = _tensors(data)
    input_ids: torch.Tensor = tensors["input_ids"]
    placed = placement(tensors["attention_mask"], int(tensors["prompts"].shape[1]))
    if len(refs) != len(placed):
        raise ValueError(f"{len(refs)} refs for {len(placed)} samples")
    spec, routes = _fetch(client, refs, direct, dtype)
    bs, seq = input_ids.shape[:2]
    out = torch.zeros((bs, seq, spec.num_layers, spec.top_k), dtype=dtype)
    for p, ref in zip(placed, refs, strict=True):
        inside = slice(p.first, p.first + p.num_tokens)
        if check_tokens:
            _check_tokens(
                routes, p.index, p.num_tokens, input_ids[p.index, inside], ref, f"sample {p.index}"
            )
        elif int(routes.lengths[p.index]) != p.num_tokens:
            raise TokenMismatch(f"{ref} holds another number of tokens than sample {p.index}")
        out[p.index, inside] = routes.ids[p.index, : p.num_tokens]
    tensors[ROUTES_KEY] = out
    return out


def resolve_nested(
    data: Any,
    client: Client,
    *,
    check_tokens: bool = True,
    direct: bool = False,
    dtype: torch.dtype = torch.int16,
) -> torch.Tensor:
    """Resolve the refs of a no-padding verl `TensorDict` (as `left_right_2_no_padding`
    makes it on the driver, and each data-parallel rank receives its chunk of) into
    `routed_experts` as that function would have made it from verl's dense tensor: a
    jagged `(bs, j, L, K)` int16 tensor on `input_ids`' offsets, one sequence of routes
    per sample's tokens. Sets it in `data` and returns it; only this rank's refs are
    read. Errors as `resolve_routes`."""
    refs = refs_of(data)
    input_ids: Any = data["input_ids"]  # a jagged nested tensor
    if not input_ids.is_nested:
        raise ValueError("resolve_nested takes a no-padding batch (jagged input_ids)")
    offsets = input_ids.offsets()
    lengths = offsets.diff().tolist()
    if len(refs) != len(lengths):
        raise ValueError(f"{len(refs)} refs for {len(lengths)} samples")
    spec, routes = _fetch(client, refs, direct, dtype)
    values = input_ids.values()
    parts = []
    for b, (ref, n) in enumerate(zip(refs, lengths, strict=True)):
        begin = int(offsets[b])
        if check_tokens:
            _check_tokens(routes, b, n, values[begin : begin + n], ref, f"sample {b}")
        elif int(routes.lengths[b]) != n:
            raise TokenMismatch(f"{ref} holds another number of tokens than sample {b}")
        parts.append(routes.ids[b, :n])
    joined = (
        torch.cat(parts) if parts else torch.zeros((0, spec.num_layers, spec.top_k), dtype=dtype)
    )
    out = torch.nested.nested_tensor_from_jagged(joined, offsets=offsets)
    data[ROUTES_KEY] = out
    return out
