"""Route refs: small values that resolve to exactly the routes they name, or raise.

Against a real server process on real S3 (SeaweedFS), with maintenance running every
second so retention happens within a test.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Iterator

import numpy as np
import pytest
import torch

from helpers import SPEC, expected_ids, make_write
from http_helpers import ServerProcess, server_maintained_each_second
from r3store.errors import InvalidInput, RefMismatch
from r3store.policy import NamespaceSettings, Retention
from r3store.protocol.wire import ReadFormat
from r3store.records import Batch, PutResult, TrajectoryWrite
from r3store.refs import RouteRef
from r3store.testing.seaweedfs import SeaweedFS
from r3store_client import Client, RolloutWriter
from r3store_client.tensors import RouteTensors, compact, padded, rank_slice


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, seaweed: SeaweedFS) -> Iterator[ServerProcess]:
    with server_maintained_each_second(tmp_path_factory.mktemp("refs"), seaweed) as process:
        yield process


def _tokened(trajectory_id: str, tokens: int | None = None, **meta: object) -> TrajectoryWrite:
    write = make_write(trajectory_id, tokens=tokens, **meta)
    ids = np.random.default_rng(len(trajectory_id)).integers(0, 50_000, write.num_tokens)
    return dataclasses.replace(write, token_ids=ids)


def _ids(routes: RouteTensors, b: int, n: int) -> np.ndarray:
    """Row b's first n tokens' ids, -1 where no route was recorded."""
    return np.where(routes.valid[b, :n].numpy(), routes.ids[b, :n].numpy(), -1)


def _ref(**change: object) -> RouteRef:
    base = RouteRef("run1", "p0/s0", ((0, 4096),), "0" * 32, 3)
    return dataclasses.replace(base, **change)  # type: ignore[arg-type]


def test_a_ref_is_a_small_checked_value() -> None:
    result = PutResult("prompt-000123/sample-07", True, 0, "engine", 8192, 41, bytes(range(16)))
    ref = RouteRef.of("qwen3-30b-grpo-run-17", result)
    text = ref.to_json()
    assert len(text.encode()) < 220
    assert RouteRef.from_json(text) == ref
    assert pickle.loads(pickle.dumps(ref)) == ref
    assert hash(RouteRef.from_json(text)) == hash(ref)
    assert ref.num_tokens == 8192
    assert ref.policy_version == 41
    assert ref != dataclasses.replace(ref, digest="f" * 32)
    bad: list[dict[str, object]] = [
        {"segments": ((0, 10), (11, 5))},  # a gap
        {"segments": ((0, 0),)},
        {"segments": ()},
        {"segments": ((True, 10),)},
        {"digest": "ABC"},
        {"digest": "g" * 32},
        {"policy_version": -1},
        {"namespace": "no spaces"},
        {"trajectory_id": ""},
        {"source": "mine"},
    ]
    for change in bad:
        with pytest.raises(InvalidInput):
            _ref(**change)
    for text in ['{"namespace": "a"}', "[1, 2]", "not json", '{"segments": [[0, 1]], "x": 1}']:
        with pytest.raises(InvalidInput):
            RouteRef.from_json(text)
    first = _ref(segments=((0, 100),), digest="1" * 32, policy_version=5)
    second = _ref(segments=((100, 50),), digest="2" * 32, policy_version=4)
    joined = RouteRef.joined([first, second])
    assert joined.segments == ((0, 100), (100, 50))
    assert joined.policy_version == 4
    assert joined.digest not in (first.digest, second.digest)
    with pytest.raises(InvalidInput):
        RouteRef.joined([second, first])  # not in token order
    with pytest.raises(InvalidInput):
        RouteRef.joined([first, _ref(trajectory_id="other", segments=((100, 50),))])


def test_refs_resolve_to_exactly_their_routes(client: Client, namespace: str) -> None:
    writes = [_tokened(f"g0/s{i}", policy_version=0) for i in range(6)]
    results = client.put(namespace, writes)
    refs = [r.ref for r in results]
    assert all(isinstance(ref, RouteRef) and ref.namespace == namespace for ref in refs)
    again = client.put(namespace, writes[:2])  # a retry: the same refs
    assert [r.ref for r in again] == refs[:2]
    assert not any(r.created for r in again)
    for rank in range(2):
        mine = rank_slice(refs, rank, 2)[::-1]  # any order: answered in the refs' order
        spec, batch = client.resolve(mine)
        assert batch.ids == [ref.trajectory_id for ref in mine]
        routes = padded(batch, spec)
        by_id = {w.trajectory_id: w for w in writes}
        for b, ref in enumerate(mine):
            want = expected_ids(by_id[ref.trajectory_id])
            n = want.shape[0]
            assert routes.lengths[b] == n
            assert np.array_equal(_ids(routes, b, n), want)
            assert routes.tokens is not None
            assert np.array_equal(routes.tokens[b, :n].numpy(), by_id[ref.trajectory_id].tokens())
    spec, direct = client.resolve(refs, direct=True)  # from the object store itself
    assert torch.equal(compact(direct, spec).ids, compact(client.resolve(refs)[1], spec).ids)


def test_turns_resolve_alone_or_joined(client: Client, namespace: str) -> None:
    whole = _tokened("turns", tokens=300)
    first = dataclasses.replace(
        whole, num_tokens=120, topk=whole.topk[:120], token_ids=whole.token_ids[:120]
    )
    second = dataclasses.replace(
        whole,
        num_tokens=180,
        start=120,
        topk=whole.topk[120:],
        token_ids=whole.token_ids[120:],
        policy_version=1,
    )
    client.set_policy_version(namespace, 1)
    one = client.put(namespace, [first])[0].ref
    two = client.put(namespace, [second])[0].ref
    assert (one.segments, two.segments) == (((0, 120),), ((120, 180),))
    both = RouteRef.joined([one, two])
    spec, batch = client.resolve([both, one, two])
    routes = padded(batch, spec)
    want = expected_ids(whole)
    assert routes.lengths.tolist() == [300, 120, 180]
    assert np.array_equal(_ids(routes, 0, 300), want)
    assert np.array_equal(_ids(routes, 1, 120)[:119], want[:119])  # the first turn only
    assert np.array_equal(_ids(routes, 2, 180), want[120:])  # the second, from 0
    assert routes.tokens is not None
    assert np.array_equal(routes.tokens[2, :180].numpy(), whole.tokens()[120:])
    assert batch.items[2] is not None
    assert batch.items[2].prompt_len == 0


def test_a_tampered_ref_raises_naming_it(client: Client, namespace: str) -> None:
    ref = client.put(namespace, [_tokened("kept")])[0].ref
    n = ref.num_tokens
    altered = [
        dataclasses.replace(ref, digest="0" * 32),
        dataclasses.replace(ref, segments=((0, n - 1),)),
        dataclasses.replace(ref, segments=((0, 10), (10, n - 10))),
        dataclasses.replace(ref, trajectory_id="never-stored"),
        dataclasses.replace(ref, source="trainer"),
        dataclasses.replace(ref, policy_version=ref.policy_version + 1),
    ]
    for bad in altered:
        with pytest.raises(RefMismatch, match=f"ref {namespace}/{bad.trajectory_id}"):
            client.resolve([ref, bad])
    assert client.resolve([ref])[1].items[0] is not None  # the genuine one still resolves


def test_a_rewritten_trajectory_does_not_resolve(client: Client, namespace: str) -> None:
    old = client.put(namespace, [make_write("again", tokens=64)])[0].ref
    client.request("DELETE", f"/v1/namespaces/{namespace}")
    client.create_namespace(namespace, SPEC)
    other = dataclasses.replace(
        make_write("again", tokens=64), topk=make_write("x", tokens=64).topk
    )
    new = client.put(namespace, [other])[0].ref
    assert new.segments == old.segments
    assert new.digest != old.digest
    with pytest.raises(RefMismatch, match="rewritten since, or the ref was altered"):
        client.resolve([old])
    client.resolve([new])
    client.request("DELETE", f"/v1/namespaces/{namespace}")
    client.create_namespace(namespace, SPEC)
    same = client.put(namespace, [make_write("again", tokens=64)])[0].ref
    assert same == old  # equal content, equal refs
    assert client.resolve([old])[1].items[0] is not None


def test_a_ref_into_a_deleted_namespace_does_not_resolve(client: Client, namespace: str) -> None:
    ref = client.put(namespace, [make_write("gone")])[0].ref
    client.request("DELETE", f"/v1/namespaces/{namespace}")
    for direct in (False, True):
        with pytest.raises(RefMismatch, match=f"ref {namespace}/gone: .*no longer stored"):
            client.resolve([ref], direct=direct)


def test_a_ref_retention_dropped_does_not_resolve(client: Client, namespace: str) -> None:
    client.update_settings(namespace, NamespaceSettings(retention=Retention(keep_versions=1)))
    ref = client.put(namespace, [make_write("old", policy_version=0)])[0].ref
    client.set_policy_version(namespace, 1)
    newer = client.put(namespace, [make_write("new", policy_version=1)])[0].ref
    deadline = time.monotonic() + 60
    while client.get_batch(namespace, ["old"], include_stale=True).items[0] is not None:
        assert time.monotonic() < deadline, "retention did not drop the old version"
        time.sleep(0.5)
    with pytest.raises(RefMismatch, match="no longer stored"):
        client.resolve([newer, ref], include_stale=True)
    assert client.resolve([newer])[1].items[0] is not None


def test_the_writer_hands_out_refs(client: Client, namespace: str) -> None:
    writes = [make_write(f"w{i}") for i in range(5)]
    bad = TrajectoryWrite("bad", 10, topk=np.zeros((9, SPEC.num_layers, 2), np.int32))
    with RolloutWriter(client, namespace, batch_size=4) as writer:
        futures = [writer.write(w) for w in writes]
        refused = writer.write(bad)
    refs = [f.result(timeout=10) for f in futures]
    assert [r.trajectory_id for r in refs] == [w.trajectory_id for w in writes]
    with pytest.raises(InvalidInput, match="bad"):
        refused.result(timeout=10)
    assert writer.report.sent == 5
    assert list(writer.report.failed) == ["bad"]
    assert client.resolve(refs)[1].ids == [w.trajectory_id for w in writes]


def test_a_read_of_some_layers_carries_only_those(client: Client, namespace: str) -> None:
    writes = [_tokened(f"l{i}", tokens=256) for i in range(4)]
    refs = [r.ref for r in client.put(namespace, writes)]
    spec, batch = client.resolve(refs, layers=[1, 3])
    assert spec.num_layers == 2
    assert batch.layers == (1, 3)
    routes = padded(batch, spec)
    for b, write in enumerate(writes):
        assert np.array_equal(_ids(routes, b, 256), expected_ids(write)[:, [1, 3]])
    _, ids_read = client.fetch(namespace, ["l0"], fmt=ReadFormat.IDS, layers=[2])
    item = ids_read.items[0]
    assert item is not None
    assert item.routes is not None
    assert np.array_equal(item.routes.to_topk()[:255], expected_ids(writes[0])[:255, [2]])
    ids = [w.trajectory_id for w in writes]

    def route_bytes(batch: Batch) -> int:
        return sum(len(s.encoded.ids) for i in batch.found for s in i.segments if s.encoded)

    whole = client.get_batch(namespace, ids, decode=False)
    one = client.get_batch(namespace, ids, decode=False, layers=[0])
    assert route_bytes(one) < route_bytes(whole) / 3  # one of four layers travels
    path = f"/v1/namespaces/{namespace}/routes/batch"
    for bad in ([3, 1], [4], [-1], [], [1, 1], [True]):
        with pytest.raises(InvalidInput, match="layers"):
            client.request("POST", path, json={"ids": ids, "layers": bad})
    with pytest.raises(InvalidInput, match="direct"):
        client.resolve(refs, direct=True, layers=[0])
