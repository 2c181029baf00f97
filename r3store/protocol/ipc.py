"""Reading Arrow IPC streams that nobody has checked yet.

Every byte of an upload is hostile until validated. pyarrow reads IPC buffers without
checking offsets against the data they index; touching the values of such an array
reads past its buffers (a crash, or another request's bytes served as routes). So a
stream is read message by message and each record batch is fully validated
(structure, offsets, lengths, null counts, UTF-8) before any value is looked at.

Compressed buffers are refused before they are decompressed: a body of a few MiB can
declare (and zstd can produce) terabytes. So are dictionary batches, which no r3store
format uses. Both are read from the message's own flatbuffer (`Message.fbs`:
`Message.header_type`, `RecordBatch.compression`), with every offset bounds-checked.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass

import pyarrow as pa

from r3store.errors import InvalidInput, PayloadTooLarge

# Message.header_type values (Message.fbs: union MessageHeader)
HEADER_TYPES = {1: "schema", 2: "dictionary batch", 3: "record batch"}
_MESSAGE_HEADER_TYPE, _MESSAGE_HEADER, _MESSAGE_BODY_LENGTH = 1, 2, 3
_BATCH_LENGTH, _BATCH_NODES, _BATCH_BUFFERS, _BATCH_COMPRESSION = 0, 1, 2, 3
# fields an upload's schema may have, nested ones counted: r3store reads 14 columns, and
# every check of a stream is linear in its fields
MAX_FIELDS = 64


class Flatbuffer:
    """Bounds-checked reads of one flatbuffer: tables, scalar fields, vectors of structs.

    Raises `InvalidInput` for any offset that points outside the buffer.
    """

    def __init__(self, data: bytes) -> None:
        self.data = data

    def _unpack(self, fmt: str, pos: int) -> int:
        if pos < 0 or pos + struct.calcsize(fmt) > len(self.data):
            raise InvalidInput("malformed Arrow IPC message: an offset points outside it")
        value: int = struct.unpack_from(fmt, self.data, pos)[0]
        return value

    def root(self) -> int:
        """Position of the root table."""
        return self._unpack("<I", 0)

    def field(self, table: int, index: int) -> int | None:
        """Position of field `index` of the table at `table`, or None when absent."""
        vtable = table - self._unpack("<i", table)
        slot = 4 + 2 * index
        if slot + 2 > self._unpack("<H", vtable):
            return None
        offset = self._unpack("<H", vtable + slot)
        return None if offset == 0 else table + offset

    def scalar(self, table: int, index: int, fmt: str, default: int = 0) -> int:
        pos = self.field(table, index)
        return default if pos is None else self._unpack(fmt, pos)

    def table(self, table: int, index: int) -> int | None:
        """Position of the table (or vector) that field `index` refers to."""
        pos = self.field(table, index)
        return None if pos is None else pos + self._unpack("<I", pos)

    def structs(self, vector: int | None, size: int) -> list[int]:
        """Positions of the elements of a vector of `size`-byte structs."""
        if vector is None:
            return []
        count = self._unpack("<I", vector)
        end = vector + 4 + count * size
        if end > len(self.data):
            raise InvalidInput("malformed Arrow IPC message: a vector runs past its end")
        return [vector + 4 + i * size for i in range(count)]


@dataclass(frozen=True)
class MessageHeader:
    """What r3store reads of one IPC message's metadata before pyarrow decodes it."""

    kind: str  # "schema", "record batch", "dictionary batch", or "type N"
    body_length: int
    compressed: bool


def message_header(metadata: bytes) -> MessageHeader:
    """Read a `Message` flatbuffer (the metadata of one IPC message)."""
    fb = Flatbuffer(metadata)
    root = fb.root()
    header_type = fb.scalar(root, _MESSAGE_HEADER_TYPE, "<B")
    kind = HEADER_TYPES.get(header_type, f"type {header_type}")
    compressed = False
    if kind == "record batch":
        header = fb.table(root, _MESSAGE_HEADER)
        compressed = header is not None and fb.field(header, _BATCH_COMPRESSION) is not None
    return MessageHeader(kind, fb.scalar(root, _MESSAGE_BODY_LENGTH, "<q"), compressed)


def _bad(what: str, exc: Exception) -> InvalidInput:
    return InvalidInput(f"the body is not a valid Arrow IPC stream: {what}: {exc}")


def count_fields(schema: pa.Schema, limit: int) -> int:
    """The fields of `schema`, nested ones counted, up to `limit + 1` (no further: a
    schema is refused past `limit` without walking the rest)."""
    stack = [field.type for field in schema]
    count = len(stack)
    while stack and count <= limit:
        kind = stack.pop()
        children = [kind.field(i).type for i in range(min(kind.num_fields, limit + 1))]
        count += len(children)
        stack.extend(children)
    return min(count, limit + 1)


def _check_schema(schema: pa.Schema) -> None:
    """At most `MAX_FIELDS` fields; field names (nested ones too) are UTF-8 and the
    columns' names are distinct."""
    if len(schema) > MAX_FIELDS or count_fields(schema, MAX_FIELDS) > MAX_FIELDS:
        raise InvalidInput(
            f"the upload's schema has more than {MAX_FIELDS} fields (nested ones counted): "
            "send the columns r3store reads (docs/api.md) and few others"
        )
    try:
        schema.to_string(show_field_metadata=False, show_schema_metadata=False)
        names = schema.names
    except (UnicodeDecodeError, pa.ArrowException) as exc:
        raise InvalidInput(
            f"the upload's schema has a field name that is not UTF-8: {exc}"
        ) from None
    twice = sorted(name for name, n in Counter(names).items() if n > 1)
    if twice:
        raise InvalidInput(f"the upload has more than one column named {twice[0]!r}")


def _check_column(batch: pa.RecordBatch, index: int, first_row: int) -> None:
    """Full validation of one column; the error names the column (and the row, for
    text that is not UTF-8)."""
    column = batch.column(index)
    name = batch.schema.field(index).name
    try:
        column.validate(full=True)
    except (pa.ArrowException, ValueError) as exc:
        if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
            raw = column.view(
                pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary()
            )
            try:
                raw.validate(full=True)
            except (pa.ArrowException, ValueError):
                raise InvalidInput(f"column {name!r} is malformed: {exc}") from None
            for row, value in enumerate(raw.to_pylist()):
                if value is not None:
                    try:
                        value.decode("utf-8")
                    except UnicodeDecodeError:
                        raise InvalidInput(
                            f"column {name!r}, row {first_row + row}: not valid UTF-8"
                        ) from None
        raise InvalidInput(f"column {name!r} is malformed: {exc}") from None


def read_table(body: bytes | bytearray | memoryview, max_rows: int | None = None) -> pa.Table:
    """An IPC stream as a table whose every buffer has been validated.

    Raises `InvalidInput` for anything but an uncompressed stream of one schema and
    record batches, and for any array that fails Arrow's full validation;
    `PayloadTooLarge` past `max_rows` rows (or record batches), before the batch that
    crosses it is validated.
    """
    reader, schema = _open(body)
    batches: list[pa.RecordBatch] = []
    rows = 0
    while True:
        try:
            message = reader.read_next_message()
        except StopIteration:
            break
        except (pa.ArrowException, OSError, ValueError) as exc:
            raise _bad(f"message {len(batches) + 1} cannot be read", exc) from None
        batch = _record_batch(message, schema, len(batches))
        if max_rows is not None and rows + batch.num_rows > max_rows:
            raise PayloadTooLarge(
                f"the upload holds more than {max_rows} rows; the limit is {max_rows} rows "
                "per upload: send fewer at a time"
            )
        if max_rows is not None and len(batches) >= max_rows:  # empty ones cost work too
            raise PayloadTooLarge(
                f"the upload holds more than {max_rows} record batches; at most one per row "
                f"of the {max_rows} an upload may hold"
            )
        for index in range(batch.num_columns):
            _check_column(batch, index, rows)
        try:
            batch.validate()  # the columns against each other
        except (pa.ArrowException, ValueError) as exc:
            raise _bad(f"record batch {len(batches)} is inconsistent", exc) from None
        rows += batch.num_rows
        batches.append(batch)
    return pa.Table.from_batches(batches, schema)


def _open(body: bytes | bytearray | memoryview) -> tuple[pa.ipc.MessageReader, pa.Schema]:
    """The stream's reader past its schema, which is checked."""
    try:
        reader = pa.ipc.MessageReader.open_stream(pa.py_buffer(body))
        first = reader.read_next_message()
    except StopIteration:
        raise InvalidInput("the body is an empty Arrow IPC stream") from None
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise InvalidInput(f"the body is not an Arrow IPC stream: {exc}") from None
    if message_header(first.metadata.to_pybytes()).kind != "schema":
        raise InvalidInput("the Arrow IPC stream does not begin with a schema")
    try:
        schema = pa.ipc.read_schema(first)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _bad("its schema cannot be read", exc) from None
    _check_schema(schema)
    return reader, schema


def _record_batch(message: pa.ipc.Message, schema: pa.Schema, index: int) -> pa.RecordBatch:
    """Message `index` after the schema as a record batch, not yet validated: only
    uncompressed record batches are accepted."""
    header = message_header(message.metadata.to_pybytes())
    if header.kind != "record batch":
        raise InvalidInput(
            f"Arrow IPC {header.kind} messages are not accepted: send one schema and record batches"
        )
    if header.compressed:
        raise InvalidInput(
            "compressed Arrow IPC buffers are not accepted: send them uncompressed "
            "(routes are compressed at rest)"
        )
    try:
        return pa.ipc.read_record_batch(message, schema)
    except (pa.ArrowException, OSError, ValueError) as exc:
        raise _bad(f"record batch {index} cannot be read", exc) from None
