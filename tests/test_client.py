"""The client against a real server process on real S3: converters, writer, reader."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import logging
import pickle
import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from helpers import SPEC, eventually, expected_ids, make_write
from http_helpers import KEYS, ServerProcess
from r3store.errors import Conflict, Forbidden, InvalidInput, InvalidRoutes, NotFound, Unauthorized
from r3store.policy import NamespaceSettings, Retention
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.seaweedfs import SeaweedFS
from r3store.testing.synthetic import uniform_topk
from r3store_client import AsyncClient, Client, Retry, RolloutWriter
from r3store_client.convert import from_hf_router, from_mask, from_sglang, from_topk, from_vllm
from r3store_client.reader import TrainerReader
from r3store_client.tensors import (
    CompactRoutes,
    Layout,
    Major,
    RouteTensors,
    compact,
    dense_masks,
    micro_batches,
    packed,
    padded,
    rank_slice,
)

L, E, K = SPEC.num_layers, SPEC.num_experts, SPEC.top_k


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    with ServerProcess(tmp_path_factory.mktemp("client"), seaweed) as process:
        yield process


def test_sglang_converter_with_its_wire_format() -> None:
    rng = np.random.default_rng(0)
    prompt, output = 7, 5
    ids = uniform_topk(rng, prompt + output - 1, L, E, K).astype("<i4")
    meta = {"routed_experts": base64.b64encode(ids.tobytes()).decode()}
    write = from_sglang("s", meta, prompt + output, L, K, group_id="g")
    assert (write.num_tokens, write.start, write.group_id) == (12, 0, "g")
    assert np.array_equal(write.topk, ids)
    # a later turn, asked with routed_experts_start_len=12 (not echoed): rows [12, 19)
    turn = uniform_topk(rng, 7, L, E, K).astype("<i4")
    meta2 = {"routed_experts": base64.b64encode(turn.tobytes()).decode()}
    appended = from_sglang("s", meta2, 20, L, K, start=12)
    assert (appended.start, appended.num_tokens) == (12, 8)
    with pytest.raises(InvalidRoutes, match="was the start given"):
        from_sglang("s", meta2, 20, L, K)  # without the start, the rows do not line up
    with pytest.raises(InvalidRoutes, match="not whole rows"):
        from_sglang("s", {"routed_experts": base64.b64encode(b"\x00" * 10).decode()}, 3, L, K)
    with pytest.raises(InvalidRoutes, match="return_routed_experts"):
        from_sglang("s", {}, 3, L, K)
    with pytest.raises(InvalidRoutes, match="expected 2"):
        from_sglang("s", meta, 3, L, K)


def test_engines_emit_dense_layers_as_zeros() -> None:
    """Both engines emit every decoder layer; DeepSeek's first dense ones are zeros."""
    rng = np.random.default_rng(2)
    moe = uniform_topk(rng, 9, L, E, K).astype("<i4")
    engine = np.concatenate([np.zeros((9, 1, K), "<i4"), moe], axis=1)  # layer 0 dense
    meta = {"routed_experts": base64.b64encode(engine.tobytes()).decode()}
    with pytest.raises(InvalidRoutes, match="layer 0 is all zeros: a dense layer"):
        from_sglang("d", meta, 10, L + 1, K)
    write = from_sglang("d", meta, 10, L + 1, K, moe_layers=range(1, L + 1))
    assert np.array_equal(write.topk, moe)
    with pytest.raises(InvalidRoutes, match="layer 0 is all zeros"):
        from_vllm("d", engine.astype(np.uint8), 10)
    assert np.array_equal(from_vllm("d", engine, 10, moe_layers=[1, 2, 3, 4]).topk, moe)
    with pytest.raises(InvalidRoutes, match="not among the engine's 5 layers"):
        from_vllm("d", engine, 10, moe_layers=[5])


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32", "int64"])
def test_vllm_converter_takes_every_integer_dtype(dtype: str) -> None:
    rng = np.random.default_rng(1)
    ids = uniform_topk(rng, 9, L, E, K).astype(dtype)
    assert from_vllm("v", ids, 10).topk.dtype == np.dtype(dtype)
    # the OpenAI server's form: base64 of an .npy file
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    served = from_vllm("v", base64.b64encode(buffer.getvalue()).decode(), 10)
    assert np.array_equal(served.topk, ids)
    # a later turn asked with routed_experts_prompt_start=10: rows [10, 14)
    turn = from_vllm("v", ids[:4], 15, prompt_start=10)
    assert (turn.start, turn.num_tokens) == (10, 5)


def test_other_converters() -> None:
    rng = np.random.default_rng(1)
    layers = [torch.from_numpy(uniform_topk(rng, 6, 1, E, K)[:, 0]) for _ in range(L)]
    write = from_hf_router("h", layers)
    assert write.topk.shape == (6, L, K)
    assert np.array_equal(write.topk[:, 2], layers[2].numpy())
    assert from_topk("t", torch.zeros(3, L, K, dtype=torch.int64), 4).topk.shape == (3, L, K)
    assert from_mask("m", np.zeros((3, L, 8), np.uint8), 4).mask.shape == (3, L, 8)
    with pytest.raises(InvalidRoutes):
        from_vllm("v", np.zeros((3, L), np.uint8), 4)
    with pytest.raises(InvalidRoutes, match="integers"):
        from_vllm("v", np.zeros((3, L, K), np.float32), 4)
    with pytest.raises(InvalidRoutes, match=r"\.npy"):
        from_vllm("v", base64.b64encode(b"not npy").decode(), 4)


def test_what_each_converter_says_of_its_slot_order() -> None:
    """Only a producer that sorts its top-k promises rank order: vLLM and SGLang capture
    their routers' ids unsorted, HF's DeepSeek-V3 family takes `sorted=False`."""
    rng = np.random.default_rng(3)
    ids = uniform_topk(rng, 9, L, E, K)
    meta = {"routed_experts": base64.b64encode(ids.astype("<i4").tobytes()).decode()}
    for engine, write in (
        ("vLLM", from_vllm("v", ids, 10)),
        ("SGLang", from_sglang("s", meta, 10, L, K)),
    ):
        assert (write.slot_order, write.producer) == ("set", engine)
    with pytest.raises(InvalidInput, match="vLLM promises no rank order"):
        from_vllm("v", ids, 10, slot_order="rank")
    with pytest.raises(InvalidInput, match="SGLang promises no rank order"):
        from_sglang("s", meta, 10, L, K, slot_order="rank")
    assert from_vllm("v", ids, 10, slot_order="verbatim").slot_order == "verbatim"
    assert from_sglang("s", meta, 10, L, K, slot_order="verbatim").slot_order == "verbatim"
    layers = [ids[:, i] for i in range(L)]
    ranked = type("Qwen3MoeTopKRouter", (), {})
    assert from_hf_router("h", layers, router=ranked).slot_order == "rank"  # a class
    assert from_hf_router("h", layers, router=ranked()).slot_order == "rank"  # a module
    unranked = from_hf_router("h", layers, router="DeepseekV3TopkRouter")
    assert (unranked.slot_order, unranked.producer) == ("set", "DeepseekV3TopkRouter")
    assert from_hf_router("h", layers, router="SomeOtherRouter").slot_order == "set"
    assert from_hf_router("h", layers).slot_order == "set"  # whose? not said
    kept = from_hf_router("h", layers, router="DeepseekV3TopkRouter", slot_order="verbatim")
    assert kept.slot_order == "verbatim"  # the caller keeps the slots as they came
    assert from_topk("t", ids, 10).slot_order == "rank"  # plain ids: the caller's word
    with pytest.raises(InvalidInput, match="slot_order must be one of"):
        TrajectoryWrite("t", 10, topk=ids, slot_order="sorted").check()  # type: ignore[arg-type]


def _npy_base64(ids: np.ndarray) -> str:
    """vLLM's OpenAI server's `routed_experts`: base64 of an `.npy` file."""
    buffer = io.BytesIO()
    np.save(buffer, ids, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode()


def _sets(ids: np.ndarray) -> np.ndarray:
    """Each token-layer's experts, sorted: what an unordered namespace gives back."""
    return np.sort(np.asarray(ids).astype(np.int64), axis=-1)


def _with_dense_layer(moe: np.ndarray) -> np.ndarray:
    """vLLM's `[rows, layers, K]`: a dense layer 0 of zeros before the MoE layers."""
    return np.concatenate([np.zeros_like(moe[:, :1]), moe], axis=1)


@pytest.mark.parametrize("encode", [True, False])
def test_vllm_routes_go_to_an_unordered_namespace(
    client: Client, server: ServerProcess, encode: bool
) -> None:
    """vLLM's slots promise no order: an ordered namespace refuses its routes before
    anything is sent (naming the trajectory and the engine), on both upload paths; an
    unordered one stores the engine's sets; `slot_order="verbatim"` keeps them as given."""
    rng = np.random.default_rng(11)
    moe = uniform_topk(rng, 9, L, E, K, np.uint8)  # in the engine's (random) slot order
    engine = _with_dense_layer(moe)
    tid = f"vllm-{encode}"
    write = from_vllm(tid, engine, 10, moe_layers=range(1, L + 1))
    ordered, sets = f"vllm-ordered-{encode}", f"vllm-sets-{encode}"
    client.create_namespace(ordered, RouteSpec(L, E, K, ordered=True))
    client.create_namespace(sets, SPEC)
    with Client(server.url, api_key=KEYS["writer"], encode=encode) as worker:
        with pytest.raises(InvalidRoutes, match="ordered=False") as caught:
            worker.put(ordered, [write])
        assert str(caught.value).startswith(f"{tid}: vLLM promises no order of the top-4")
        assert "ordered=False" in str(caught.value)
        assert client.get_batch(ordered, [tid]).missing == [tid]
        worker.put(sets, [write])
        worker.put(
            ordered, [from_vllm(tid, engine, 10, moe_layers=[1, 2, 3, 4], slot_order="verbatim")]
        )
    stored = client.get_batch(sets, [tid]).items[0]
    assert stored is not None
    assert stored.routes is not None
    assert np.array_equal(stored.routes.to_topk()[:9], _sets(moe))  # the engine's sets
    kept = client.get_batch(ordered, [tid]).items[0]
    assert kept is not None
    assert kept.routes is not None
    assert np.array_equal(kept.routes.to_topk()[:9], moe)  # the engine's slots, as given


def test_the_async_client_refuses_them_too(client: Client, server: ServerProcess) -> None:
    rng = np.random.default_rng(12)
    write = from_vllm("vllm-async", uniform_topk(rng, 5, L, E, K, np.uint8), 6)
    client.create_namespace("vllm-async-ordered", RouteSpec(L, E, K, ordered=True))

    async def put() -> None:
        async with AsyncClient(server.url, api_key=KEYS["writer"]) as worker:
            await worker.put("vllm-async-ordered", [write])

    with pytest.raises(InvalidRoutes, match=r"^vllm-async: vLLM promises no order"):
        asyncio.run(put())
    assert client.get_batch("vllm-async-ordered", ["vllm-async"]).missing == ["vllm-async"]


def test_vllm_uint16_ids_past_256_experts_round_trip(client: Client) -> None:
    """Kimi K2's 384 experts: vLLM sends uint16 ids, as an array or as the OpenAI
    server's `.npy`; both store and read back the engine's sets."""
    experts, k = 384, 8
    spec = RouteSpec(L, experts, k)
    client.create_namespace("vllm-k2", spec)
    rng = np.random.default_rng(13)
    moe = uniform_topk(rng, 11, L, experts, k, np.uint16)
    assert moe.max() > 255
    engine = _with_dense_layer(moe)
    tokens = np.arange(100, 112, dtype=np.int32)
    writes = [
        from_vllm(f"k2-{name}", form, 12, moe_layers=range(1, L + 1), token_ids=tokens)
        for name, form in (("array", engine), ("npy", _npy_base64(engine)))
    ]
    assert all(np.asarray(w.topk).dtype == np.uint16 for w in writes)
    client.put("vllm-k2", writes)
    batch = client.get_batch("vllm-k2", [w.trajectory_id for w in writes])
    for item in batch.items:
        assert item is not None
        assert item.routes is not None
        back = item.routes.to_topk()
        assert np.array_equal(back[:11], _sets(moe))
        assert (back[11] == -1).all()  # the last sampled token: not recorded
        assert item.token_ids is not None
        assert item.token_ids.tolist() == tokens.tolist()


def test_a_vllm_turn_from_prompt_start_is_an_appended_segment(
    client: Client, namespace: str
) -> None:
    """Turn 1: 6 prompt + 4 sampled tokens, rows [0, 9). Turn 2 asked with
    `routed_experts_prompt_start=10` over the whole 17-token sequence (3 new prompt
    tokens, 4 sampled): rows [10, 16), sent by the OpenAI server as an `.npy`. Token 9,
    turn 1's last sampled token, ran only in turn 2's prefill, before its prompt start:
    it has no recorded route."""
    rng = np.random.default_rng(14)
    first_moe = uniform_topk(rng, 9, L, E, K, np.uint8)
    second_moe = uniform_topk(rng, 6, L, E, K, np.uint8)
    tokens = np.arange(1, 18, dtype=np.int32)
    first = from_vllm(
        "turns",
        _with_dense_layer(first_moe),
        10,
        moe_layers=range(1, L + 1),
        token_ids=tokens[:10],
        group_id="g",
    )
    second = from_vllm(
        "turns",
        _npy_base64(_with_dense_layer(second_moe)),
        17,
        prompt_start=10,
        moe_layers=range(1, L + 1),
        token_ids=tokens[10:],
        policy_version=1,
    )
    assert (second.start, second.num_tokens) == (10, 7)
    client.put(namespace, [first])
    client.put(namespace, [second])
    item = client.get_batch(namespace, ["turns"]).items[0]
    assert item is not None
    assert item.routes is not None
    assert (item.num_tokens, len(item.segments), item.group_id) == (17, 2, "g")
    back = item.routes.to_topk()
    assert np.array_equal(back[:9], _sets(first_moe))
    assert (back[9] == -1).all()
    assert np.array_equal(back[10:16], _sets(second_moe))
    assert (back[16] == -1).all()
    assert item.token_ids is not None
    assert item.token_ids.tolist() == tokens.tolist()


def test_writer_to_server_to_reader(client: Client, namespace: str) -> None:
    writes = [make_write(f"w{i}", group_id=f"g{i // 2}", policy_version=1) for i in range(9)]
    with RolloutWriter(client, namespace, batch_size=4) as writer:
        for w in writes:
            writer.write(w)
    assert writer.report.sent == 9
    assert not writer.report.failed
    assert not writer.report.unsent
    ids = [w.trajectory_id for w in writes]
    reader = TrainerReader(client, namespace)
    small = reader.fetch(ids[:4])
    assert isinstance(small, CompactRoutes)
    longest = max(w.num_tokens for w in writes[:4])
    assert small.ids.shape == (4, longest, L, K)
    assert small.ids.dtype == torch.uint8  # 64 experts: a byte a slot
    assert small.counts.shape == (4, longest, L)
    assert small.nbytes == 4 * longest * L * (K + 1)
    routes = small.widen()
    assert routes.ids.dtype == torch.int32
    wide = TrainerReader(client, namespace, compact=False, major="token").fetch(ids[:4])
    assert isinstance(wide, RouteTensors)
    assert torch.equal(wide.ids, routes.ids)
    assert torch.equal(wide.valid, routes.valid)
    for b, w in enumerate(writes[:4]):
        want = expected_ids(w)
        n = w.num_tokens
        got = routes.ids[b, :n].numpy()
        valid = routes.valid[b, :n].numpy()
        assert np.array_equal(np.where(valid, got, -1), want)
        assert not routes.valid[b, n:].any()
        # no repeated ids anywhere, padding and the unrecorded last token included
        sorted_ids = np.sort(routes.ids[b].numpy(), axis=-1)
        assert (sorted_ids[..., 1:] != sorted_ids[..., :-1]).all()
    pack = TrainerReader(client, namespace, layout="packed").fetch(ids[:3])
    assert pack.cu_seqlens is not None
    assert pack.cu_seqlens.tolist() == [0, *np.cumsum([w.num_tokens for w in writes[:3]]).tolist()]
    assert pack.ids.shape == (sum(w.num_tokens for w in writes[:3]), L, K)


LAYOUTS = [("padded", "layer"), ("padded", "token"), ("packed", "layer"), ("packed", "token")]


@pytest.mark.parametrize(("layout", "major"), LAYOUTS)
def test_padding_holds_no_route_whatever_the_memory_held_before(
    client: Client, namespace: str, layout: Layout, major: Major
) -> None:
    """Buffers are not zeroed when they are made: every token a trajectory does not
    cover (padding, to the longest or to `pad_to`) is written empty, even where the
    allocator hands back memory another tensor filled."""
    lengths = (30, 75, 50)
    writes = [make_write(f"pad-{layout}-{major}-{i}", tokens=t) for i, t in enumerate(lengths)]
    client.put(namespace, writes)
    spec, batch = client.fetch(namespace, [w.trajectory_id for w in writes])
    starts = [0, *np.cumsum(lengths).tolist()]
    for _ in range(3):
        dirty = [torch.full((3, 96, L, K), 255, dtype=torch.uint8), torch.full((3, 96, L), 7)]
        del dirty
        got = compact(batch, spec, layout, major, pad_to=96 if layout == "padded" else None)
        routes = got.widen()
        for b, w in enumerate(writes):
            n = w.num_tokens
            at: Any = (b, slice(0, n)) if layout == "padded" else slice(starts[b], starts[b] + n)
            valid = routes.valid[at].numpy()
            assert np.array_equal(np.where(valid, routes.ids[at].numpy(), -1), expected_ids(w))
            if layout == "padded":
                assert not got.counts[b, n:].any()
                assert not got.ids[b, n:].any()
                assert not routes.valid[b, n:].any()


def test_layouts_agree(client: Client, namespace: str) -> None:
    writes = [make_write(f"x{i}") for i in range(3)]
    client.put(namespace, writes)
    spec, batch = client.fetch(namespace, [w.trajectory_id for w in writes])
    pad, pack, masks = padded(batch, spec), packed(batch, spec), dense_masks(batch, spec)
    assert masks.shape == (3, pad.ids.shape[1], L, E)
    for b, w in enumerate(writes):
        n, start = w.num_tokens, int(pack.cu_seqlens[b])
        assert torch.equal(pack.ids[start : start + n], pad.ids[b, :n])
        chosen = masks[b, : n - 1].nonzero()[:, -1].reshape(n - 1, L, K).numpy()
        assert np.array_equal(chosen, np.sort(np.asarray(w.topk), axis=-1))
        assert not masks[b, n - 1].any()  # the unrecorded last token
    # the ids in a dtype of the caller's: the same values; refused where ids could wrap
    narrowest = compact(batch, spec, "packed", "token")
    wide = compact(batch, spec, "packed", "token", dtype=torch.int16)
    assert (narrowest.ids.dtype, wide.ids.dtype) == (torch.uint8, torch.int16)
    assert torch.equal(wide.ids, narrowest.ids.to(torch.int16))
    assert torch.equal(wide.counts, narrowest.counts)
    with pytest.raises(InvalidInput, match="cannot hold the ids of 300 experts"):
        compact(batch, dataclasses.replace(spec, num_experts=300), "packed", dtype=torch.uint8)
    for dtype in (torch.float32, torch.bool, torch.quint8):
        with pytest.raises(InvalidInput, match="route ids cannot be of dtype"):
            compact(batch, spec, "packed", "token", dtype=dtype)


def test_typed_errors_and_pickling(client: Client, namespace: str, server: ServerProcess) -> None:
    client.put(namespace, [make_write("p")])
    other = make_write("q")
    with pytest.raises(Conflict):
        client.put(namespace, [TrajectoryWrite("p", other.num_tokens, topk=other.topk)])
    with pytest.raises(NotFound):
        client.namespace("no-such-namespace")
    with (
        Client(server.url, api_key="wrong-key-0123456789abcdef") as stranger,
        pytest.raises(Unauthorized),
    ):
        stranger.namespace(namespace)
    clone = pickle.loads(pickle.dumps(client))
    assert clone._http is None
    assert clone.get_batch(namespace, ["p"]).items[0] is not None
    clone.close()


def test_prefetch_overlaps_by_events(client: Client, namespace: str) -> None:
    writes = [make_write(f"e{i}") for i in range(6)]
    client.put(namespace, writes)
    events: list[tuple[str, int]] = []
    reader = TrainerReader(client, namespace, on_event=lambda what, i: events.append((what, i)))
    batches = micro_batches([w.trajectory_id for w in writes], 2)
    for index, _routes in enumerate(reader.iterate(batches)):
        events.append(("compute_start", index))
        time.sleep(0.05)  # stands in for the forward and backward pass
        events.append(("compute_end", index))
    for index in range(len(batches) - 1):
        started = events.index(("fetch_start", index + 1))
        assert started < events.index(("compute_end", index)), events


@pytest.mark.parametrize("depth", [2, 3])
def test_prefetch_depth_runs_ahead_and_no_further(
    client: Client, namespace: str, depth: int
) -> None:
    writes = [make_write(f"d{i}") for i in range(8)]
    client.put(namespace, writes)
    events: list[tuple[str, int]] = []
    reader = TrainerReader(
        client, namespace, depth=depth, on_event=lambda what, i: events.append((what, i))
    )
    batches = micro_batches([w.trajectory_id for w in writes], 1)
    for index, routes in enumerate(reader.iterate(batches)):
        assert routes.ids.shape[0] == 1
        time.sleep(0.15)  # a long compute step: every fetch ahead finishes meanwhile
        started = {i for what, i in events if what == "fetch_start"}
        assert max(started) == min(index + depth, len(batches) - 1), events  # no further
        events.append(("compute_end", index))
    for index in range(len(batches) - depth):
        assert events.index(("fetch_end", index + depth)) < events.index(("compute_end", index)), (
            events
        )
    with pytest.raises(ValueError, match="depth"):
        TrainerReader(client, namespace, depth=0)


def test_lazy_pools_are_made_once_under_racing_threads() -> None:
    client = Client("http://127.0.0.1:9")  # never contacted
    barrier = threading.Barrier(16)

    def first_use(_: int) -> tuple[int, int, int]:
        barrier.wait()
        store, fetchers = client._direct()
        return id(client.decoders), id(store), id(fetchers)

    with ThreadPoolExecutor(16) as pool:
        made = set(pool.map(first_use, range(16)))
    assert len(made) == 1
    clone = pickle.loads(pickle.dumps(client))  # its lock is made anew
    assert clone.decoders is clone.decoders
    clone.close()
    client.close()


def test_rank_slices_cover_the_batch_once() -> None:
    ids = [f"t{i}" for i in range(10)]
    parts = [rank_slice(ids, r, 4) for r in range(4)]
    assert [len(p) for p in parts] == [3, 3, 2, 2]
    assert [tid for part in parts for tid in part] == ids
    with pytest.raises(ValueError, match="rank 4"):
        rank_slice(ids, 4, 4)


def test_writer_survives_a_server_outage(
    tmp_path: Path, seaweed: SeaweedFS, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="r3store.client")
    first = ServerProcess(tmp_path, seaweed)
    port, prefix = first.port, first.prefix
    client = Client(first.url, api_key=KEYS["admin"], retry=Retry(attempts=2, backoff=0.05))
    client.create_namespace("ns", SPEC)
    writer = RolloutWriter(client, "ns", batch_size=2, retry_backoff=0.1)
    before = [make_write(f"a{i}") for i in range(4)]
    for w in before:
        writer.write(w)
    assert writer.flush(timeout=30)
    first.kill()
    during = [make_write(f"b{i}") for i in range(4)]
    for w in during:
        writer.write(w)  # queued while the server is away
    eventually(  # tried and failed twice: nothing of it acknowledged meanwhile
        lambda: any("upload failed again" in r.getMessage() for r in caplog.records),
        "the writer retrying while the server is away",
    )
    assert writer.report.sent == 4
    second = ServerProcess(tmp_path, seaweed, prefix=prefix, port=port)
    try:
        assert writer.flush(timeout=60)
        report = writer.close()
        assert report.sent == 8
        assert not report.failed
        assert not report.unsent
        batch = client.get_batch("ns", [w.trajectory_id for w in before + during])
        assert batch.missing == []
    finally:
        second.stop()
    # the outage is one WARNING when uploads start failing and one when they recover;
    # the retries in between are INFO
    logged = [r for r in caplog.records if r.name == "r3store.client"]
    warnings = [r.getMessage() for r in logged if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    failing, recovered = warnings
    assert "failing (StoreError:" in failing
    assert "keeps retrying" in failing
    assert first.url in failing
    attempts = sum("upload failed again" in r.getMessage() for r in logged) + 1
    assert attempts >= 2  # a second or more of retries every 0.1-0.8 s
    pattern = r"recovered after (\d+\.\d) s of failures \((\d+) failed attempts\)"
    match = re.search(pattern, recovered)
    assert match, recovered
    assert float(match.group(1)) >= 1.0  # the writer waited at least the sleep above
    assert int(match.group(2)) == attempts
    # a server that stays away: close() gives up and names what it could not send
    stranded = RolloutWriter(client, "ns", retry_backoff=0.05)
    stranded.write(make_write("c0"))
    report = stranded.close(timeout=1.0)
    assert report.unsent == ["c0"]
    client.close()


def test_writer_reports_refused_trajectories(client: Client, namespace: str) -> None:
    bad = TrajectoryWrite("bad", 5, topk=np.zeros((4, L, K), np.int32))  # duplicate experts
    with RolloutWriter(client, namespace, batch_size=8) as writer:
        writer.write(make_write("good1"))
        writer.write(bad)
        writer.write(make_write("good2"))
    assert writer.report.sent == 2
    assert list(writer.report.failed) == ["bad"]
    assert client.get_batch(namespace, ["good1", "good2", "bad"]).missing == ["bad"]


def test_spec_reported_with_routes(client: Client, namespace: str) -> None:
    client.put(namespace, [make_write("s")])
    spec, _ = client.fetch(namespace, ["s"])
    assert spec == RouteSpec(L, E, K)


@pytest.mark.parametrize("encode", [True, False])
def test_transposed_routes_of_the_same_size_are_refused(
    client: Client, namespace: str, server: ServerProcess, encode: bool
) -> None:
    """A `[layers, tokens - 1, top_k]` array holds as many bytes as the right one: sent
    as bytes it would be read as other routes. The client checks the shape first, on
    both paths (a writer key: describing the namespace for its spec is allowed)."""
    tid = f"transposed-{encode}"  # the namespace fixture gives both cases one namespace
    write = make_write(tid, tokens=100)
    ids = np.asarray(write.topk)
    transposed = np.ascontiguousarray(ids.transpose(1, 0, 2))  # [4, 99, 4]
    assert transposed.nbytes == ids.nbytes
    masks = np.zeros((L, 99, 8), np.uint8)  # [layers, tokens - 1, ceil(E / 8)]
    masks[..., 0] = 0b1111  # experts 0-3 everywhere: valid masks, had they been given right
    refused = [
        (TrajectoryWrite(tid, 100, topk=transposed), r"top-k ids of shape \[4, 99, 4\]"),
        (TrajectoryWrite(tid, 100, mask=masks), r"masks of shape \[4, 99, 8\]"),
    ]
    with Client(server.url, api_key=KEYS["writer"], encode=encode) as worker:
        for bad, given in refused:
            with pytest.raises(InvalidRoutes, match=given + r"; expected \[99, 4, ") as caught:
                worker.put(namespace, [bad])
            assert str(caught.value).startswith(f"{tid}: ")
        assert client.get_batch(namespace, [tid]).missing == [tid]
        worker.put(namespace, [write])  # the same routes the right way round are stored
    stored = client.get_batch(namespace, [tid]).items[0]
    assert stored is not None
    assert np.array_equal(stored.routes.to_topk()[:99], expected_ids(write)[:99])


def test_ensure_namespace_survives_an_operator_changing_its_settings(
    client: Client, server: ServerProcess
) -> None:
    """A worker's start: the namespace must exist with its spec; the operator's settings
    are the operator's. Creating it takes an admin key; describing it, any key."""
    name = "ensured"
    with (
        Client(server.url, api_key=KEYS["writer"]) as worker,
        Client(server.url, api_key=KEYS["reader"]) as trainer,
    ):
        with pytest.raises(Forbidden, match="needs an admin key"):
            worker.ensure_namespace(name, SPEC)
        with pytest.raises(NotFound):
            client.namespace(name)  # the refusal made nothing
        made = client.ensure_namespace(name, SPEC)  # an admin key creates it
        assert made.spec.to_spec() == SPEC
        assert made.settings == NamespaceSettings()
        changed = NamespaceSettings(max_policy_lag=2, retention=Retention(keep_versions=4))
        client.update_settings(name, changed)  # as `r3store settings ... --keep-versions 4`
        with pytest.raises(Conflict, match="other settings"):
            client.create_namespace(name, SPEC)  # what workers called: fails once they moved
        for who in (client, worker, trainer):
            info = who.ensure_namespace(name, SPEC)
            assert info.settings == changed
            assert info.spec.to_spec() == SPEC
        worker.put(name, [make_write("after-settings")])  # its spec, asked once, kept
        with pytest.raises(Conflict, match=r"top_k 4 \(asked: 2\)") as caught:
            worker.ensure_namespace(name, RouteSpec(L, E, 2))
        assert "num_layers" not in str(caught.value)  # only the fields that differ
        with pytest.raises(Conflict, match=r"num_experts 64 \(asked: 128\), ordered False"):
            client.ensure_namespace(name, RouteSpec(L, 128, K, ordered=True))
    assert client.namespace(name).settings == changed  # nothing changed it back


def test_token_ids_without_decoding_routes(client: Client, namespace: str) -> None:
    rng = np.random.default_rng(7)
    first = TrajectoryWrite(
        "turns", 10, topk=uniform_topk(rng, 10, L, E, K), token_ids=np.arange(10)
    )
    second = TrajectoryWrite("turns", 5, topk=uniform_topk(rng, 4, L, E, K), start=10)
    bare = make_write("bare")
    client.put(namespace, [first, bare])
    client.put(namespace, [second])  # an appended turn sent without its token ids
    got = client.token_ids(namespace, ["turns", "bare", "absent"])
    assert list(got) == ["turns", "bare"]  # the missing id is left out
    turns = got["turns"]
    assert turns is not None
    assert turns.dtype == np.int32
    assert turns.tolist() == [*range(10), -1, -1, -1, -1, -1]
    assert got["bare"] is None


def test_an_upload_the_server_timed_out_as_too_slow_is_sent_again(
    server: ServerProcess, namespace: str
) -> None:
    import httpx

    real = httpx.HTTPTransport()
    answered: list[int] = []

    class SlowOnce(httpx.BaseTransport):
        """The first upload meets the 408 a stalled network gets (`R3STORE_BODY_TIMEOUT`);
        every request goes to the real server."""

        def handle_request(self, request: httpx.Request) -> httpx.Response:
            if request.url.path.endswith("/trajectories") and not answered:
                answered.append(408)
                body = b'{"error": {"code": "request_timeout", "message": "too slow"}}'
                return httpx.Response(408, content=body, headers={"connection": "close"})
            return real.handle_request(request)

        def close(self) -> None:
            real.close()

    http = httpx.Client(base_url=server.url, transport=SlowOnce(), timeout=30)
    retry = Retry(attempts=3, backoff=0.05)
    with Client(server.url, KEYS["admin"], http=http, retry=retry, direct_writes=False) as c:
        [result] = c.put(namespace, [make_write("slow-once")])
        assert result.created
        assert answered == [408]
        assert c.get_batch(namespace, ["slow-once"]).missing == []
    http.close()
