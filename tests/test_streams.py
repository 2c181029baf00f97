"""Routes a client encoded itself: stored as the server would have stored them, checked
by decoding, and refused, changing nothing, when they are not exactly canonical."""

from __future__ import annotations

import subprocess
import sys
import zlib
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest
import zstandard

from helpers import SPEC, MakeEngine, expected_ids, make_write
from http_helpers import KEYS, ServerProcess, auth, make_namespace, service, upload
from r3store.engine import Engine
from r3store.errors import InvalidInput, InvalidRoutes
from r3store.logic import streams
from r3store.logic.codec import Transform
from r3store.logic.streams import MAX_ROW_BYTES, SentStreams
from r3store.logic.writes import canonical_routes, encode_write
from r3store.protocol.wire import decode_writes, encode_writes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.storage.store import LocalStore
from r3store.testing.synthetic import uniform_topk
from r3store_client import Client

SPECS = [
    RouteSpec(4, 64, 4),
    RouteSpec(3, 300, 2),  # uint16 ids
    RouteSpec(4, 64, 4, ordered=True),
    RouteSpec(2, 64, 12, ordered=True),  # order as positions, K > 8
    RouteSpec(3, 32, 4, allow_fewer=True),
    RouteSpec(3, 32, 4, ordered=True, allow_fewer=True),
]


def _fewer(write: TrajectoryWrite, seed: int) -> TrajectoryWrite:
    """Some slots emptied (-1), in the producer's order anywhere in the row."""
    ids = np.asarray(write.topk).astype(np.int32).copy()
    rng = np.random.default_rng(seed)
    ids[rng.random(ids.shape) < 0.3] = -1
    return replace(write, topk=ids)


def writes_for(spec: RouteSpec, n: int = 5) -> list[TrajectoryWrite]:
    out = []
    for i in range(n):
        write = make_write(f"t{i}", spec, token_ids=None)
        if spec.allow_fewer:
            write = _fewer(write, i)
        if i == 1:  # with token ids, metadata and a group
            tokens = np.arange(write.num_tokens, dtype=np.int32)
            write = replace(write, token_ids=tokens, group_id="g", prompt_len=3)
        out.append(write)
    return out


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_client_encoded_routes_are_the_same_content(
    tmp_path: Path, make_engine: MakeEngine, spec: RouteSpec
) -> None:
    engine = make_engine(LocalStore(tmp_path / "o"))
    engine.namespaces.create("ns", spec)
    writes = writes_for(spec)
    encoded = [encode_write(w, spec) for w in writes]
    assert all(w.encoded is not None and w.topk is None for w in encoded)
    assert [r.created for r in engine.put("ns", encoded)] == [True] * len(writes)
    # the same routes sent as ids are the same content: acknowledged, not stored again
    assert [r.created for r in engine.put("ns", writes)] == [False] * len(writes)
    batch = engine.get_batch("ns", [w.trajectory_id for w in writes])
    for write, item in zip(writes, batch.items, strict=True):
        assert item is not None
        got = item.routes.to_topk()
        want = canonical_routes(write, spec)
        assert np.array_equal(got, want.to_topk()), write.trajectory_id
        if not spec.allow_fewer:
            assert np.array_equal(got, expected_ids(write, spec))
    assert engine.namespaces.count("ns") == len(writes)


def _stored(tmp_path: Path, make_engine: MakeEngine, spec: RouteSpec) -> Engine:
    engine = make_engine(LocalStore(tmp_path / "o"))
    engine.namespaces.create("ns", spec)
    return engine


def _frame(data: bytes, size: bool = True) -> bytes:
    if size:
        return zstandard.ZstdCompressor(level=1).compress(data)
    return zstandard.ZstdCompressor(level=1, write_content_size=False).compress(data)


SET = RouteSpec(2, 16, 2)
T = 3  # tokens: 6 token-layers of 2 slots


def _sent(
    ids: list[int], counts: list[int] | None = None, order: bytes | None = None
) -> SentStreams:
    blob = _frame(np.array(ids, np.uint8).tobytes())
    count_blob = None if counts is None else _frame(np.array(counts, np.uint8).tobytes())
    return SentStreams(blob, int(Transform.SORTED), count_blob, order)


GOOD = [1, 5, 0, 3, 2, 9, 4, 15, 6, 7, 10, 11]
BAD: list[tuple[str, Callable[[], SentStreams], RouteSpec, str]] = [
    ("unsorted", lambda: _sent([5, 1, *GOOD[2:]]), SET, "token 0, layer 0: chosen experts"),
    ("repeated", lambda: _sent([*GOOD[:6], 4, 4, *GOOD[8:]]), SET, "token 0, layer 1"),
    ("id past E", lambda: _sent([*GOOD[:11], 16]), SET, "num_experts 16"),
    ("count past K", lambda: _sent(GOOD, [2, 2, 3, 2, 2, 2]), SET, "above top_k"),
    ("fewer", lambda: _sent([1, 0, *GOOD[2:]], [1, 2, 2, 2, 2, 2]), SET, "allow_fewer"),
    (
        "empty slot not 0",
        lambda: _sent([1, 5, *GOOD[2:]], [1, 2, 2, 2, 2, 2]),
        RouteSpec(2, 16, 2, allow_fewer=True),
        "empty slot that is not 0",
    ),
    (
        "unsorted beside a row of fewer",
        lambda: _sent([1, 0, 3, 2, *GOOD[4:]], [1, 2, 2, 2, 2, 2]),
        RouteSpec(2, 16, 2, allow_fewer=True),
        "token 1, layer 0: chosen experts not strictly ascending",
    ),
    (
        "id past E beside a row of fewer",
        lambda: _sent([1, 0, *GOOD[2:11], 16], [1, 2, 2, 2, 2, 2]),
        RouteSpec(2, 16, 2, allow_fewer=True),
        "token 2, layer 1: an expert id >= num_experts 16",
    ),
    ("short", lambda: _sent(GOOD[:10]), SET, "declares 10 bytes"),
    (
        "no size",
        lambda: SentStreams(_frame(bytes(GOOD), size=False), 0),
        SET,
        "declares no size",
    ),
    (
        "trailing bytes",
        lambda: SentStreams(_frame(bytes(GOOD)) + b"\x00", 0),
        SET,
        "not one zstd frame of 12 bytes",
    ),
    ("not zstd", lambda: SentStreams(zlib.compress(bytes(GOOD)), 0), SET, "not a zstd frame"),
    ("transform", lambda: replace(_sent(GOOD), transform=7), SET, "unknown route transform 7"),
    ("order where none", lambda: _sent(GOOD, order=_frame(bytes(12))), SET, "takes no order"),
    (
        "no order",
        lambda: _sent(GOOD),
        RouteSpec(2, 16, 2, ordered=True),
        "needs an order stream",
    ),
    (
        "rank past k!",
        lambda: _sent(GOOD, order=_frame(np.array([0, 1, 2, 0, 0, 0], np.uint16).tobytes())),
        RouteSpec(2, 16, 2, ordered=True),
        "token 2, layer 0: an order rank >= 2!",
    ),
    (
        "empty slot ranked first",
        lambda: _sent(
            [1, 0, *GOOD[2:]],
            [1, 2, 2, 2, 2, 2],
            order=_frame(np.array([1, 0, 0, 0, 0, 0], np.uint16).tobytes()),
        ),
        RouteSpec(2, 16, 2, ordered=True, allow_fewer=True),
        "empty slots last",
    ),
    (
        "empty slot ranked first, a later row",
        lambda: _sent(
            [*GOOD[:4], 2, 0, *GOOD[6:]],
            [2, 2, 1, 2, 2, 2],
            order=_frame(np.array([1, 0, 1, 0, 0, 0], np.uint16).tobytes()),
        ),
        RouteSpec(2, 16, 2, ordered=True, allow_fewer=True),
        "token 2, layer 0: an order that does not keep empty slots last",
    ),
]


@pytest.mark.parametrize(("name", "make", "spec", "says"), BAD, ids=[b[0] for b in BAD])
def test_streams_that_are_not_canonical_are_refused(
    tmp_path: Path,
    make_engine: MakeEngine,
    name: str,
    make: Callable[[], SentStreams],
    spec: RouteSpec,
    says: str,
) -> None:
    engine = _stored(tmp_path, make_engine, spec)
    good = TrajectoryWrite("good", T, encoded=_sent(GOOD))
    if not spec.ordered:
        assert engine.put("ns", [good])[0].created  # the base case is fine
    with pytest.raises(InvalidRoutes, match=says):
        engine.put("ns", [TrajectoryWrite("bad", T, encoded=make())])
    assert engine.get_batch("ns", ["bad"]).missing == ["bad"]


def test_a_permutation_stream_must_be_a_permutation(
    tmp_path: Path, make_engine: MakeEngine
) -> None:
    spec = RouteSpec(1, 64, 9, ordered=True)
    engine = _stored(tmp_path, make_engine, spec)
    write = encode_write(make_write("p", spec, tokens=4), spec)
    assert write.encoded is not None
    positions = np.tile(np.arange(9, dtype=np.uint8), 4)
    positions[9 + 3] = 0  # token 1 names sorted slot 0 twice (and an index past its row)
    bad = replace(write.encoded, order=_frame(positions.tobytes()))
    with pytest.raises(InvalidRoutes, match="token 1, layer 0: an order that is not a perm"):
        engine.put("ns", [replace(write, encoded=bad)])
    assert engine.namespaces.count("ns") == 0


def test_counts_all_k_are_the_same_content_as_none(tmp_path: Path, make_engine: MakeEngine) -> None:
    engine = _stored(tmp_path, make_engine, SET)
    assert engine.put("ns", [TrajectoryWrite("a", T, encoded=_sent(GOOD))])[0].created
    same = TrajectoryWrite("a", T, encoded=_sent(GOOD, [2] * 6))
    assert not engine.put("ns", [same])[0].created  # no second copy, no conflict


def test_a_decompression_bomb_is_refused_before_it_is_decompressed(
    tmp_path: Path, make_engine: MakeEngine
) -> None:
    spec = RouteSpec(48, 128, 8)
    engine = _stored(tmp_path, make_engine, spec)
    tokens = MAX_ROW_BYTES // (48 * 8) + 1
    bomb = SentStreams(_frame(bytes(1 << 20)), 0)  # a small frame; the claim is what counts
    with pytest.raises(InvalidRoutes, match="decode to more than 64 MiB"):
        engine.put("ns", [TrajectoryWrite("bomb", tokens, encoded=bomb)])


BOMB = """
import resource, struct
from r3store.errors import InvalidRoutes
from r3store.spec import RouteSpec
from r3store.logic.streams import SentStreams, accept

spec, tokens = RouteSpec(8, 64, 8), 65536  # 4 MiB of uint8 ids
declared, block, blocks = 8 * tokens * 8, 1 << 17, 4096  # 512 MiB of RLE blocks
header = struct.pack("<IBBI", 0xFD2FB528, 0x80, 7 << 3, declared)  # 128 KiB window
body = b"".join(
    ((block << 3) | (1 << 1) | (i == blocks - 1)).to_bytes(3, "little") + b"\\x01"
    for i in range(blocks)
)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    accept(SentStreams(header + body, 0), spec, tokens, b"", None, "bomb")
    print("accepted")
except InvalidRoutes as exc:
    print("refused:", exc)
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_a_frame_that_lies_about_its_size_stops_at_that_size() -> None:
    """A frame declaring 4 MiB whose blocks expand to 512 MiB: refused, and the
    decompression stops at the declared size instead of making all of it."""
    done = subprocess.run(
        [sys.executable, "-c", BOMB], capture_output=True, text=True, timeout=120, check=True
    )
    verdict, grew = done.stdout.strip().splitlines()
    assert verdict.startswith("refused: bomb: the ids stream is not one zstd frame")
    assert int(grew) < 64, f"memory grew by {grew} MiB"


def test_encoded_uploads_over_http(tmp_path: Path) -> None:
    spec = RouteSpec(4, 64, 4)  # the namespace http_helpers makes
    ids = uniform_topk(np.random.default_rng(3), 99, 4, 64, 4)
    plain = TrajectoryWrite("h", 100, topk=ids)
    with service(tmp_path, None) as client:
        make_namespace(client)
        first = upload(client, [encode_write(plain, spec)])
        assert first.status_code == 200, first.text
        assert first.json()["results"][0]["created"] is True
        again = upload(client, [plain])  # as ids: the same content
        assert again.json()["results"][0]["created"] is False
        tampered = replace(encode_write(plain, spec), trajectory_id="x")
        assert tampered.encoded is not None
        raw = bytearray(canonical_routes(plain, spec).layers.tobytes())  # sorted ids, layer-major
        raw[0], raw[1] = raw[1], raw[0]  # the first set out of order
        sent = replace(tampered.encoded, ids=_frame(bytes(raw)), transform=0)
        refused = upload(client, [replace(tampered, encoded=sent)])
        assert refused.status_code == 400
        assert refused.json()["error"]["code"] == "invalid_routes"
        assert "x: token 0, layer 0" in refused.json()["error"]["message"]
        body = client.get("/v1/namespaces/ns", headers=auth("admin")).json()
        assert body["trajectories"] == 1


def test_an_upload_decodes_to_a_bounded_total() -> None:
    spec = RouteSpec(48, 128, 8)
    tokens = MAX_ROW_BYTES // (48 * 8)  # each row at the per-segment limit
    rows = [TrajectoryWrite(f"r{i}", tokens, encoded=_sent(GOOD)) for i in range(5)]
    with pytest.raises(InvalidInput, match=r"decode to \d+ bytes; at most 268435456"):
        decode_writes(encode_writes(rows), spec)


def test_the_client_sends_too_long_segments_as_ids(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(streams, "MAX_ROW_BYTES", 4 * 50 * 4)  # L * T * K bytes: 50 tokens
    kinds: list[str] = []

    def seen(request: httpx.Request) -> None:
        if request.url.path.endswith("/trajectories"):
            table = pa.ipc.open_stream(request.read()).read_all()
            kinds.extend(table.column("routes_kind").to_pylist())

    server = ServerProcess(tmp_path, None)
    try:
        with (
            httpx.Client(base_url=server.url, event_hooks={"request": [seen]}) as http,
            Client(server.url, api_key=KEYS["admin"], http=http) as client,
        ):
            client.create_namespace("long", SPEC)
            short, long = make_write("s", SPEC, tokens=50), make_write("l", SPEC, tokens=51)
            client.put("long", [short, long])
            assert kinds == ["encoded", "topk"]
            assert client.get_batch("long", ["s", "l"]).missing == []
    finally:
        server.stop()
