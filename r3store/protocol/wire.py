"""The binary wire formats: Arrow IPC streams for trajectories in and routes out.

Routes never travel as JSON. Both directions are Arrow IPC *streams* (the format of
`pyarrow.ipc.new_stream`, Arrow C++ `RecordBatchStreamWriter`, arrow-rs `StreamWriter`);
docs/api.md lists every column. Shared by the server and the client.

Each direction has its module: uploads (`uploads.py`: `encode_writes`,
`decode_writes`) and read answers (`answers.py`: `answer_bytes`, `encode_batch`,
`encode_chunks`, `decode_batch`), over what both share (`formats.py`). This module names them all in
one place, the import every caller uses.
"""

from __future__ import annotations

from r3store.protocol.answers import (
    CHUNK_BYTES,
    STREAM_END,
    answer_bytes,
    decode_batch,
    encode_batch,
    encode_chunks,
)
from r3store.protocol.formats import (
    CONTENT_TYPE,
    MAX_ROWS,
    ROUTE_DTYPES,
    WIRE_VERSION,
    ReadFormat,
    RouteKind,
)
from r3store.protocol.uploads import (
    UPLOAD_COLUMNS,
    decode_writes,
    encode_writes,
    route_shape_error,
)

__all__ = [
    "CHUNK_BYTES",
    "CONTENT_TYPE",
    "MAX_ROWS",
    "ROUTE_DTYPES",
    "STREAM_END",
    "UPLOAD_COLUMNS",
    "WIRE_VERSION",
    "ReadFormat",
    "RouteKind",
    "answer_bytes",
    "decode_batch",
    "decode_writes",
    "encode_batch",
    "encode_chunks",
    "encode_writes",
    "route_shape_error",
]
