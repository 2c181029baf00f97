"""Hostile upload bodies: valid Arrow IPC uploads, then mutated where it hurts.

`layout(stream)` finds every message of an IPC stream and, in its record batches, the
field nodes (length, null count) and buffers (offset, length, bytes). `MUTATIONS` turn a
valid body into a hostile one: flipped bytes, lengths and null counts that lie, offsets
past their buffers, text that is not UTF-8, columns of another type, compressed or
dictionary-encoded buffers, metadata of any kind, truncation. Each takes a `Chooser`, so
hypothesis (shrinking) and a seeded `random.Random` (counting, in the benchmark) drive
the same mutations.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

import numpy as np
import pyarrow as pa

from r3store.errors import R3StoreError
from r3store.logic.writes import encode_write
from r3store.protocol.ipc import Flatbuffer, message_header, read_table
from r3store.protocol.wire import encode_writes
from r3store.records import TrajectoryWrite
from r3store.spec import RouteSpec
from r3store.testing.synthetic import uniform_topk

T = TypeVar("T")
FUZZ_SPEC = RouteSpec(num_layers=2, num_experts=16, top_k=2)
INTERESTING = (
    0,
    1,
    2,
    7,
    8,
    255,
    256,
    2**15,
    2**31 - 1,
    2**31,
    2**32,
    2**62,
    -1,
    -(2**31),
    -(2**63),
)
BAD_TEXT = (b"\xff", b"\xc0\x80", b"\xed\xa0\x80", b"\xc2\x85", b"\x00", b"\xe2\x82")


class Chooser(Protocol):
    """Where mutations get their choices; both raise `ValueError` when there is none."""

    def integer(self, low: int, high: int) -> int: ...

    def choice(self, options: Sequence[T]) -> T: ...


class RandomChooser:
    """A `Chooser` over `random.Random(seed)`."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def integer(self, low: int, high: int) -> int:
        return self.rng.randint(low, high)

    def choice(self, options: Sequence[T]) -> T:
        return options[self.rng.randrange(len(options))]


@dataclass
class Buffer:
    field_at: int  # position of its (offset, length) in the stream
    start: int  # its bytes in the stream
    length: int


@dataclass
class Message:
    kind: str
    start: int  # of its metadata flatbuffer
    end: int  # of its body
    nodes: list[int] = field(default_factory=list)  # positions of (length, null_count)
    buffers: list[Buffer] = field(default_factory=list)


def layout(stream: bytes) -> list[Message]:
    """The messages of a well-formed IPC stream (continuation markers, as pyarrow writes)."""
    messages, pos = [], 0
    while pos + 8 <= len(stream):
        marker, size = struct.unpack_from("<Ii", stream, pos)
        if marker != 0xFFFFFFFF or size <= 0:
            break
        start = pos + 8
        metadata = stream[start : start + size]
        header = message_header(metadata)
        body = start + size
        message = Message(header.kind, start, body + header.body_length)
        if header.kind == "record batch":
            fb = Flatbuffer(metadata)
            batch = fb.table(fb.root(), 2)
            if batch is None:
                raise ValueError("a record batch message without its header")
            message.nodes = [start + p for p in fb.structs(fb.table(batch, 1), 16)]
            for p in fb.structs(fb.table(batch, 2), 16):
                offset, length = struct.unpack_from("<qq", metadata, p)
                message.buffers.append(Buffer(start + p, body + offset, length))
        messages.append(message)
        if message.end <= pos or message.end > len(stream):
            break
        pos = message.end
    return messages


def base_bodies() -> list[tuple[bytes, list[TrajectoryWrite]]]:
    """Valid uploads of `FUZZ_SPEC`: several dtypes, kinds (encoded streams too), and
    optional columns."""
    rng = np.random.default_rng(7)
    spec = FUZZ_SPEC
    out = []
    for case, dtype in enumerate(("int32", "uint8", "int64", "uint16", "int8")):
        writes = []
        for row in range(1 + case % 3):
            tokens = int(rng.integers(2, 9))
            ids = uniform_topk(rng, tokens - 1, spec.num_layers, spec.num_experts, spec.top_k)
            writes.append(
                TrajectoryWrite(
                    f"fuzz/{case}/{row}",
                    tokens,
                    topk=ids.astype(dtype),
                    group_id=None if row % 2 else f"group{case}",
                    policy_version=row,
                    prompt_len=1,
                    token_ids=np.arange(tokens) if case % 2 else None,
                )
            )
        out.append((encode_writes(writes), writes))
    encoded = []  # as the client sends them: its own streams, checked by decoding
    for row in range(3):
        tokens = int(rng.integers(2, 9))
        ids = uniform_topk(rng, tokens - 1, spec.num_layers, spec.num_experts, spec.top_k)
        write = TrajectoryWrite(f"fuzz/encoded/{row}", tokens, topk=ids, policy_version=row)
        encoded.append(encode_write(write, spec))
    out.append((encode_writes(encoded), encoded))
    return out


def _put(stream: bytes, at: int, fmt: str, value: int) -> bytes:
    data = bytearray(stream)
    size = struct.calcsize(fmt)
    if at + size > len(data):
        return stream
    limit = 1 << (8 * size)
    struct.pack_into(fmt.replace("q", "Q").replace("i", "I"), data, at, value % limit)
    return bytes(data)


def _batches(stream: bytes) -> list[Message]:
    return [m for m in layout(stream) if m.kind == "record batch"]


def flip_byte(stream: bytes, c: Chooser) -> bytes:
    data = bytearray(stream)
    data[c.integer(0, len(data) - 1)] = c.integer(0, 255)
    return bytes(data)


def flip_metadata(stream: bytes, c: Chooser) -> bytes:
    """A byte of a message's flatbuffer: types, lengths, custom metadata."""
    message = c.choice(layout(stream))
    data = bytearray(stream)
    data[c.integer(message.start, message.start + 64)] = c.integer(0, 255)
    return bytes(data)


def lie_node(stream: bytes, c: Chooser) -> bytes:
    """A field node's length or null count."""
    message = c.choice(_batches(stream))
    at = c.choice(message.nodes) + 8 * c.integer(0, 1)
    return _put(stream, at, "<q", c.choice(INTERESTING))


def lie_buffer(stream: bytes, c: Chooser) -> bytes:
    """A buffer's offset or length in the body."""
    message = c.choice(_batches(stream))
    at = c.choice(message.buffers).field_at + 8 * c.integer(0, 1)
    return _put(stream, at, "<q", c.choice(INTERESTING))


def lie_offsets(stream: bytes, c: Chooser) -> bytes:
    """One entry of a buffer read as offsets: past the data, negative, decreasing."""
    message = c.choice(_batches(stream))
    buffers = [b for b in message.buffers if b.length >= 8]
    buffer = c.choice(buffers)
    wide = c.integer(0, 1)
    size = 8 if wide else 4
    slot = c.integer(0, max(0, buffer.length // size - 1))
    value = c.choice((*INTERESTING, buffer.length + 1, 1 << 20))
    return _put(stream, buffer.start + slot * size, "<q" if wide else "<i", value)


def bad_bytes(stream: bytes, c: Chooser) -> bytes:
    """Bytes inside a buffer: invalid UTF-8, control characters, out-of-range ids."""
    message = c.choice(_batches(stream))
    buffer = c.choice([b for b in message.buffers if b.length > 0])
    text = c.choice((*BAD_TEXT, bytes([c.integer(0, 255)]) * c.integer(1, 8)))
    at = buffer.start + c.integer(0, buffer.length - 1)
    data = bytearray(stream)
    end = min(at + len(text), buffer.start + buffer.length)
    data[at:end] = text[: end - at]
    return bytes(data)


def truncate(stream: bytes, c: Chooser) -> bytes:
    return stream[: c.integer(0, len(stream) - 1)]


def _table(stream: bytes) -> pa.Table:
    """The table of a body still valid (a mutation that rebuilds the stream must not
    touch the values of an array that lies about its buffers)."""
    return read_table(stream)


def _write(table: pa.Table, **options: Any) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**options)) as w:
        w.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data


_SAME_LAYOUT = {
    pa.string(): (pa.binary(),),
    pa.binary(): (pa.string(),),
    pa.large_binary(): (pa.large_string(),),
    pa.large_string(): (pa.large_binary(),),
    pa.int64(): (pa.float64(), pa.uint64(), pa.timestamp("s"), pa.date64()),
}


def retype(stream: bytes, c: Chooser) -> bytes:
    """Declare a column as another type of the same layout (no value is converted)."""
    table = _table(stream)
    index = c.integer(0, table.num_columns - 1)
    column = table.column(index).combine_chunks()
    options = _SAME_LAYOUT.get(column.type)
    if not options:
        return stream
    new_type = c.choice(options)
    swapped = pa.Array.from_buffers(new_type, len(column), column.buffers(), column.null_count)
    fields = list(table.schema)
    fields[index] = pa.field(fields[index].name, new_type)
    columns = [*table.columns]
    columns[index] = swapped
    return _write(pa.table(columns, schema=pa.schema(fields)))


def reshape(stream: bytes, c: Chooser) -> bytes:
    """Columns dropped, duplicated, renamed, dictionary-encoded, or made null."""
    table = _table(stream)
    index = c.integer(0, table.num_columns - 1)
    name = table.column_names[index]
    how = c.choice(("drop", "duplicate", "rename", "dictionary", "nulls"))
    if how == "drop":
        return _write(table.remove_column(index))
    if how == "duplicate":
        return _write(table.append_column(name, table.column(index)))
    if how == "rename":
        return _write(
            table.rename_columns(
                [*table.column_names[:index], "x", *table.column_names[index + 1 :]]
            )
        )
    if how == "dictionary":
        return _write(table.set_column(index, name, table.column(index).dictionary_encode()))
    nulls = pa.nulls(table.num_rows, table.column(index).type)
    return _write(table.set_column(index, name, nulls))


def compress(stream: bytes, c: Chooser) -> bytes:
    return _write(_table(stream), compression=c.choice(("zstd", "lz4")))


def schema_metadata(stream: bytes, c: Chooser) -> bytes:
    table = _table(stream)
    key = bytes(c.integer(0, 255) for _ in range(c.integer(0, 8)))
    value = bytes(c.integer(0, 255) for _ in range(c.integer(0, 64)))
    return _write(table.replace_schema_metadata({key: value}))


MUTATIONS: dict[str, Callable[[bytes, Chooser], bytes]] = {
    "flip_byte": flip_byte,
    "flip_metadata": flip_metadata,
    "lie_node": lie_node,
    "lie_buffer": lie_buffer,
    "lie_offsets": lie_offsets,
    "bad_bytes": bad_bytes,
    "truncate": truncate,
    "retype": retype,
    "reshape": reshape,
    "compress": compress,
    "schema_metadata": schema_metadata,
}


def mutate(bodies: list[bytes], c: Chooser) -> tuple[str, bytes]:
    """One hostile body: a valid one with one to three mutations."""
    body = c.choice(bodies)
    names = []
    for _ in range(c.integer(1, 3)):
        name = c.choice(sorted(MUTATIONS))
        names.append(name)
        try:
            body = MUTATIONS[name](body, c)
        except (pa.ArrowException, R3StoreError, OSError, ValueError, IndexError, struct.error):
            break  # a body too broken for this mutation's own reading: send it as it is
    return "+".join(names), body
