"""What both wire formats share (`wire.py` describes them): the wire version, the content
type, the row limit of an upload, the route dtypes and kinds an upload may send, the
formats a read may answer in, and writing a table as one Arrow IPC stream."""

from __future__ import annotations

from enum import StrEnum

import pyarrow as pa

WIRE_VERSION = "1"
CONTENT_TYPE = "application/vnd.apache.arrow.stream"
MAX_ROWS = 100_000
ROUTE_DTYPES = ("int8", "uint8", "int16", "uint16", "int32", "uint32", "int64", "uint64")


class RouteKind(StrEnum):
    TOPK = "topk"  # [rows, L, K] expert ids, -1 for an empty slot
    MASK = "mask"  # [rows, L, ceil(E/8)] uint8 bit-packed sets
    ENCODED = "encoded"  # the streams codec.encode makes (r3store.logic.streams checks them)


class ReadFormat(StrEnum):
    ENCODED = "encoded"  # the stored zstd streams, as they are (fastest; decode with r3store)
    IDS = "ids"  # [T, L, K] ids of the id dtype, token-major, and counts
    MASK = "mask"  # [T, L, ceil(E/8)] bit-packed masks, token-major


def arrow_stream(table: pa.Table) -> bytes:
    """`table` as one Arrow IPC stream."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data: bytes = sink.getvalue().to_pybytes()
    return data
