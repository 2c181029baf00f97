"""Crafted uploads against a real server process: each gets a clear 4xx, the process
lives, and nothing is stored (least of all bytes the client did not send)."""

from __future__ import annotations

import struct
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pytest

from helpers import SPEC
from http_helpers import KEYS, SPEC_JSON, ServerProcess
from r3store.errors import InvalidRoutes
from r3store.protocol.wire import CONTENT_TYPE, encode_writes
from r3store.records import TrajectoryWrite
from r3store.testing.arrow_fuzz import layout
from r3store.testing.synthetic import uniform_topk

ADMIN = {"Authorization": f"Bearer {KEYS['admin']}"}
UPLOAD = "/v1/namespaces/ns/trajectories"
# buffers of an `encode_writes` body, in column order (validity, offsets, data ...)
TRAJECTORY_ID_OFFSETS, GROUP_ID_DATA = 1, 13


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    made = ServerProcess(tmp_path_factory.mktemp("hostile"), None)
    try:
        with httpx.Client(base_url=made.url, headers=ADMIN) as http:
            r = http.post("/v1/namespaces", json={"name": "ns", "spec": SPEC_JSON})
            assert r.status_code == 201, r.text
        yield made
    finally:
        made.stop()


@pytest.fixture
def http(server: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, headers=ADMIN, timeout=30) as client:
        yield client


def stored(http: httpx.Client) -> int:
    return int(http.get("/v1/namespaces/ns").json()["trajectories"])


def send(http: httpx.Client, body: bytes) -> httpx.Response:
    return http.post(UPLOAD, content=body, headers={"Content-Type": CONTENT_TYPE})


def refused(http: httpx.Client, server: ServerProcess, body: bytes, code: str) -> str:
    """Send `body`; check the answer is a 400 with `code`, the server alive and nothing
    stored; return the message."""
    before = stored(http)
    r = send(http, body)
    assert server.process.poll() is None, "the server died"
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == code
    assert stored(http) == before
    return str(error["message"])


def patch(body: bytes, buffer: int, fmt: str, values: list[int]) -> bytes:
    """Overwrite the start of one buffer of the record batch with `values`."""
    [batch] = [m for m in layout(body) if m.kind == "record batch"]
    data = bytearray(body)
    struct.pack_into(f"<{len(values)}{fmt}", data, batch.buffers[buffer].start, *values)
    return bytes(data)


def writes(n: int = 2, dtype: str = "int32", **meta: object) -> list[TrajectoryWrite]:
    rng = np.random.default_rng(n)
    return [
        TrajectoryWrite(
            f"t{i}",
            9,
            topk=uniform_topk(rng, 8, SPEC.num_layers, SPEC.num_experts, SPEC.top_k, dtype),
            **meta,  # type: ignore[arg-type]
        )
        for i in range(n)
    ]


def test_string_offsets_past_their_buffer(http: httpx.Client, server: ServerProcess) -> None:
    # the second id claims a gigabyte of characters: reading it crashed the process
    body = patch(encode_writes(writes()), TRAJECTORY_ID_OFFSETS, "i", [0, 2, 1 << 30])
    message = refused(http, server, body, "invalid_input")
    assert "'trajectory_id'" in message


def test_binary_offsets_reaching_into_other_bytes(
    http: httpx.Client, server: ServerProcess
) -> None:
    """A route blob whose offsets run past the routes buffer into the bytes after it
    (here another column's, which happen to be valid routes) is refused, not stored."""
    rng = np.random.default_rng(3)
    rows = 8
    routes, extra = (
        uniform_topk(rng, rows, SPEC.num_layers, SPEC.num_experts, SPEC.top_k, "uint8").tobytes()
        for _ in range(2)
    )
    table = pa.table(
        {
            "trajectory_id": ["heap"],
            "num_tokens": pa.array([2 * rows + 1], pa.int64()),
            "routes_dtype": ["uint8"],
            "routes": pa.array([routes], pa.large_binary()),
            "extra": pa.array([extra], pa.binary(len(extra))),  # right after the routes
        }
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    body = sink.getvalue().to_pybytes()
    routes_offsets = 9  # buffers: id 0-2, num_tokens 3-4, dtype 5-7, routes 8-10
    patched = patch(body, routes_offsets, "q", [0, 2 * len(routes)])
    message = refused(http, server, patched, "invalid_input")
    assert "'routes'" in message


def test_stray_bytes_after_binary_offsets(http: httpx.Client, server: ServerProcess) -> None:
    """An offsets buffer longer than its offsets (not a whole number of them) is read
    for what it holds, not answered 500."""
    write = writes(1, "uint8")[0]
    table = pa.table(
        {
            "trajectory_id": ["stray"],
            "num_tokens": pa.array([write.num_tokens], pa.int64()),
            "routes_dtype": ["uint8"],
            "routes": pa.array([np.ascontiguousarray(write.topk).tobytes()], pa.large_binary()),
        }
    )
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    body = bytearray(sink.getvalue().to_pybytes())
    [batch] = [m for m in layout(bytes(body)) if m.kind == "record batch"]
    routes_offsets = batch.buffers[9]  # buffers: id 0-2, num_tokens 3-4, dtype 5-7, routes 8-10
    assert routes_offsets.length == 16
    struct.pack_into("<q", body, routes_offsets.field_at + 8, 19)  # 2 offsets and 3 bytes
    before = stored(http)
    r = send(http, bytes(body))
    assert r.status_code == 200, r.text
    assert stored(http) == before + 1


def test_invalid_utf8_names_column_and_row(http: httpx.Client, server: ServerProcess) -> None:
    body = encode_writes(writes(2, group_id="gg"))
    bad = patch(body, GROUP_ID_DATA, "B", [ord("g"), ord("g"), 0xFF])  # row 1 starts at byte 2
    message = refused(http, server, bad, "invalid_input")
    assert "column 'group_id', row 1" in message
    assert "UTF-8" in message
    # the same pooled connection serves the next request
    assert send(http, body).status_code == 200


@pytest.mark.parametrize(
    ("dtype", "value"),
    [("int64", 2**40 + 5), ("int64", -(2**63)), ("uint64", 2**64 - 1), ("uint32", 2**32 - 60)],
)
def test_wide_ids_are_checked_as_sent(
    http: httpx.Client, server: ServerProcess, dtype: str, value: int
) -> None:
    [write] = writes(1)
    ids = np.asarray(write.topk).astype(dtype)
    ids[3, 2, 1] = value  # narrowed to 32 bits it would read as a valid expert
    body = encode_writes([TrajectoryWrite("wide", 9, topk=ids)])
    message = refused(http, server, body, "invalid_routes")
    assert f"expert id {value} out of range [0, 64) at token 3, layer 2, slot 1" in message


def test_the_client_sends_ids_at_their_own_width() -> None:
    ids = np.zeros((2, SPEC.num_layers, SPEC.top_k), np.uint64)
    ids[...] = np.arange(SPEC.top_k) + 2**33
    table = pa.ipc.open_stream(encode_writes([TrajectoryWrite("u", 3, topk=ids)])).read_all()
    assert table.column("routes_dtype").to_pylist() == ["uint64"]
    with pytest.raises(InvalidRoutes, match="integers"):
        encode_writes([TrajectoryWrite("f", 3, topk=ids.astype(np.float32))])


@pytest.mark.parametrize("bad", ["a\x85b", "a\x9fb", "tab\there", "x\x7f"])
def test_control_characters_in_ids(http: httpx.Client, server: ServerProcess, bad: str) -> None:
    [write] = writes(1)
    for kind in ("trajectory", "group"):
        made = (
            TrajectoryWrite(bad, 9, topk=write.topk)
            if kind == "trajectory"
            else TrajectoryWrite("ok", 9, topk=write.topk, group_id=bad)
        )
        message = refused(http, server, encode_writes([made]), "invalid_input")
        assert f"invalid {kind} id" in message
    r = http.post("/v1/namespaces/ns/routes/batch", json={"ids": [bad]})
    assert r.status_code == 400


def test_lone_surrogates_in_json_ids(http: httpx.Client) -> None:
    r = http.post(
        "/v1/namespaces/ns/routes/batch",
        content=b'{"ids": ["a\\ud800b"]}',
        headers={"Content-Type": "application/json"},
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "invalid_input"


@pytest.mark.parametrize(
    "mutate",
    [
        lambda t: t.append_column("routes", t.column("routes")),
        lambda t: t.set_column(0, "trajectory_id", t.column(0).dictionary_encode()),
    ],
    ids=["duplicate-column", "dictionary"],
)
def test_schema_shapes(http: httpx.Client, server: ServerProcess, mutate: object) -> None:
    table = pa.ipc.open_stream(encode_writes(writes(1))).read_all()
    changed = mutate(table)  # type: ignore[operator]
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, changed.schema) as w:
        w.write_table(changed)
    refused(http, server, sink.getvalue().to_pybytes(), "invalid_input")


def test_compressed_bodies_are_refused_before_decompression(
    http: httpx.Client, server: ServerProcess
) -> None:
    table = pa.ipc.open_stream(encode_writes(writes(1))).read_all()
    sink = pa.BufferOutputStream()
    options = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, table.schema, options=options) as w:
        w.write_table(table)
    message = refused(http, server, sink.getvalue().to_pybytes(), "invalid_input")
    assert "compressed" in message


def test_server_log_has_no_traceback(server: ServerProcess, tmp_path: Path) -> None:
    del tmp_path
    log = Path(server.log.name).read_text()
    assert "Traceback" not in log
    assert '"level": "error"' not in log


def test_json_bodies_are_bounded(http: httpx.Client, server: ServerProcess) -> None:
    huge = b'{"ids": ["' + b"a" * (5 << 20) + b'"]}'
    headers = {"Content-Type": "application/json"}
    declared = http.post("/v1/namespaces/ns/routes/batch", content=huge, headers=headers)
    streamed = http.post(
        "/v1/namespaces/ns/routes/batch",
        content=iter([huge[: 1 << 20], huge[1 << 20 :]]),
        headers=headers,
    )
    for response in (declared, streamed):
        assert response.status_code == 413, response.text
        assert response.json()["error"]["code"] == "payload_too_large"
    assert server.process.poll() is None
