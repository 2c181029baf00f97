"""TransferQueue's samples as r3store trajectories, and back (torch required; no
TransferQueue import: `r3store_client.transferqueue` does the I/O).

A route field of a TransferQueue put holds one integer tensor `[T, L, K]` per sample
(verl: `routed_experts`, int16, over the sample's `prompt_len + response_len` tokens,
zero rows where the engine recorded no route). Each sample becomes one trajectory of
`T` tokens; a row of K zeros (K > 1) is stored as no route, as `r3store_client.verl`
stores it. What the controller keeps for the sample (its backend meta, `SampleMeta`) is
the trajectory's ref, the tensor's dtype and shape: enough to give back exactly the
tensor that was put, or to refuse. The writes keep each token-layer's slots as put
(`slot_order="verbatim"`): the engine's slot order, which for vLLM and SGLang is no rank
order, kept only so that the tensor comes back bit for bit.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from r3store_client.extras import missing

try:
    import torch
except ImportError as exc:
    raise missing("torch", __name__, "torch") from exc

from r3store.errors import InvalidInput, RefMismatch
from r3store.records import VERBATIM, TrajectoryWrite
from r3store.refs import RouteRef
from r3store.spec import RouteSpec
from r3store_client.tensors import CompactRoutes, holds_ids
from r3store_client.turn_routes import TurnsMeta

INTEGER_DTYPES = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (torch.int16, torch.int32, torch.int64, torch.uint8, torch.int8)
}


@dataclass(frozen=True)
class SampleMeta:
    """One sample's route field as the controller keeps it: `ref` (JSON) names the
    stored trajectory (None for a sample of no tokens, which is stored nowhere);
    `dtype` and `shape` are the tensor's as it was put."""

    ref: str | None
    dtype: str
    shape: tuple[int, int, int]

    def to_backend(self) -> dict[str, Any]:
        return {"ref": self.ref, "dtype": self.dtype, "shape": list(self.shape)}

    @classmethod
    def from_backend(cls, value: object, field: str) -> SampleMeta:
        """The meta the controller handed back; `RefMismatch` when it is not one this
        backend wrote (the field was put through another backend, or altered)."""
        ref = dtype = shape = None
        if isinstance(value, dict):
            ref, dtype, shape = value.get("ref"), value.get("dtype"), value.get("shape")
        if (
            not (ref is None or isinstance(ref, str))
            or dtype not in INTEGER_DTYPES
            or not isinstance(shape, list | tuple)
            or len(shape) != 3
            or not all(isinstance(n, int) and n >= 0 for n in shape)
        ):
            raise RefMismatch(
                f"{field}: the sample's backend meta {value!r:.200} is not an r3store ref: "
                "was it put through another storage backend?"
            )
        return cls(ref, dtype, (shape[0], shape[1], shape[2]))

    def route_ref(self) -> RouteRef | None:
        return None if self.ref is None else RouteRef.from_json(self.ref)


def per_sample(value: Any, field: str) -> list[torch.Tensor]:
    """A field's value in a put, one tensor per sample: the components of a nested
    tensor, or the rows of a dense one."""
    if not isinstance(value, torch.Tensor):
        raise InvalidInput(f"{field} must be a tensor per sample, got {type(value).__name__}")
    return list(value.unbind()) if value.is_nested else list(value)


def describe(value: torch.Tensor, field: str) -> SampleMeta:
    """A sample's tensor before it is stored (no ref yet): integer `[T, L, K]`, or
    refused."""
    dtype = str(value.dtype).removeprefix("torch.")
    if dtype not in INTEGER_DTYPES or value.dim() != 3:
        raise InvalidInput(
            f"{field}: each sample's routes must be an integer tensor [T, L, K], got "
            f"{value.dtype} {list(value.shape)}"
        )
    tokens, layers, k = (int(n) for n in value.shape)
    return SampleMeta(None, dtype, (tokens, layers, k))


def new_trajectory_id(partition: str) -> str:
    """A trajectory id of its own for a sample: TransferQueue reuses its sample indexes
    after a clear, so they cannot name what is stored."""
    return f"tq/{partition}/{uuid.uuid4().hex}"


def turn_writes(whole: TrajectoryWrite, turns: TurnsMeta | None) -> list[TrajectoryWrite]:
    """A sample's write (`sample_write`) as it is stored: whole, or with `turns` a
    segment per turn, appended in order, each with its turn's policy version (else the
    sample's); the prompt length and group go with the first."""
    if turns is None:
        return [whole]
    assert whole.topk is not None
    out = []
    for start, length, version in turns.segments(whole.num_tokens):
        end = start + length
        out.append(
            dataclasses.replace(
                whole,
                num_tokens=length,
                topk=whole.topk[start:end],
                start=start,
                prompt_len=whole.prompt_len if start == 0 and whole.prompt_len <= length else 0,
                group_id=whole.group_id if start == 0 else None,
                policy_version=whole.policy_version if version is None else version,
                token_ids=None if whole.token_ids is None else whole.token_ids[start:end],
            )
        )
    return out


def _zero_rows(ids: np.ndarray) -> np.ndarray:
    """`[T, L]`: which token-layers of `ids` `[T, L, K]` hold K zeros, each row's bytes
    read as a few wide words (a reduction along K is slow in numpy)."""
    row = ids.shape[-1] * ids.itemsize
    width = next(w for w in (8, 4, 2, 1) if row % w == 0)
    words = np.ascontiguousarray(ids).view(f"u{width}")
    held = words[..., 0].copy()
    for j in range(1, words.shape[-1]):
        held |= words[..., j]
    zero: np.ndarray = held == 0
    return zero


def sample_write(
    trajectory_id: str,
    routes: torch.Tensor,
    spec: RouteSpec,
    *,
    token_ids: torch.Tensor | None = None,
    prompt_len: int = 0,
    group_id: str | None = None,
    policy_version: int = 0,
) -> TrajectoryWrite:
    """One sample's routes `[T, L, K]` as a trajectory write: its token ids with it
    when they are `T` of them, a prompt length past `T` dropped (the write refuses
    none); K zeros in a row (K > 1) stored as no route; negative ids refused."""
    tokens, layers, k = (int(n) for n in routes.shape)  # as `describe` checked
    if (layers, k) != (spec.num_layers, spec.top_k):
        raise InvalidInput(
            f"{trajectory_id}: routes of {layers} layers and top-{k} in a namespace of "
            f"{spec.num_layers} layers and top-{spec.top_k}"
        )
    ids = routes.detach().cpu().numpy()
    if ids.dtype.kind == "i" and ids.size and int(ids.min()) < 0:
        raise InvalidInput(
            f"{trajectory_id}: routes hold negative ids, which a read would give back as "
            "zeros: a token-layer without a route is a row of K zeros"
        )
    empty = _zero_rows(ids) if k > 1 else None
    if empty is not None and empty.any():  # a copy: the caller's tensor stays as it is
        ids = ids.astype(np.int32 if ids.dtype.kind == "u" else ids.dtype)
        ids[empty] = -1
    tokens_np = None
    if token_ids is not None and tuple(token_ids.shape) == (tokens,):
        tokens_np = token_ids.detach().cpu().numpy().astype(np.int32)
    return TrajectoryWrite(
        trajectory_id,
        num_tokens=tokens,
        topk=ids,
        prompt_len=prompt_len if 0 <= prompt_len <= tokens else 0,
        group_id=group_id,
        policy_version=policy_version,
        token_ids=tokens_np,
        slot_order=VERBATIM,  # the engine's slots as put: a tensor given back bit for bit
        producer="TransferQueue",
    )


def sample_tensors(
    metas: Sequence[SampleMeta], routes: CompactRoutes | None, field: str
) -> list[torch.Tensor]:
    """Each sample's tensor as it was put, from the routes its refs resolved to (token
    -major, packed, in the order of the samples that have a ref; a view of them where
    they are of the sample's dtype); `RefMismatch` when what is stored is not the shape
    the sample was put with."""
    out = []
    b = 0
    for meta in metas:
        dtype = INTEGER_DTYPES[meta.dtype]
        if meta.ref is None:
            out.append(torch.zeros(meta.shape, dtype=dtype))
            continue
        assert routes is not None
        assert routes.cu_seqlens is not None
        at, n = int(routes.cu_seqlens[b]), int(routes.lengths[b])
        got = routes.ids[at : at + n]
        if (n, *got.shape[1:]) != meta.shape:
            raise RefMismatch(
                f"{field}: {meta.ref} holds routes {[n, *got.shape[1:]]}, but the sample was "
                f"put as {list(meta.shape)}"
            )
        out.append(got.to(dtype))
        b += 1
    return out


def read_dtype(metas: Sequence[SampleMeta], spec: RouteSpec) -> torch.dtype | None:
    """The dtype to read samples' routes in (`tensors.compact`): the one they were put
    in, when they share it and it holds every expert id of `spec` (their tensors are
    then views of the read); else None, the narrowest (each sample is then cast to its
    own dtype, which held its ids when it was put)."""
    dtypes = {meta.dtype for meta in metas if meta.ref is not None}
    if len(dtypes) != 1:
        return None
    dtype = INTEGER_DTYPES[dtypes.pop()]
    return dtype if holds_ids(dtype, spec) else None
