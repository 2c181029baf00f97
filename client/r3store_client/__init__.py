"""The r3store client: rollout workers write routes, trainers read and replay them.

`Client`, `RolloutWriter`, their asyncio twins `AsyncClient` and `AsyncRolloutWriter`
(one set of calls, two transports: `r3store_client.calls`), route refs (`RouteRef`) and
the converters need no torch; `r3store_client.tensors`,
`r3store_client.reader` and `r3store_client.replay` do (`pip install 'r3store[torch]'`), and
`r3store_client.megatron` needs megatron-core too (`'r3store[megatron]'`). Importing one
module loads only what it needs: the replay modules do not load the HTTP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r3store.leases import Checkpoint, Lease, Resumed
    from r3store.refs import RouteRef
    from r3store_client.aio import AsyncClient, AsyncRolloutWriter
    from r3store_client.client import Client, Retry
    from r3store_client.writer import RolloutWriter, WriterReport

__all__ = [
    "AsyncClient",
    "AsyncRolloutWriter",
    "Checkpoint",
    "Client",
    "Lease",
    "Resumed",
    "Retry",
    "RolloutWriter",
    "RouteRef",
    "WriterReport",
]
_WHERE = {
    "AsyncClient": "r3store_client.aio",
    "AsyncRolloutWriter": "r3store_client.aio",
    "RouteRef": "r3store.refs",
    "Lease": "r3store.leases",
    "Checkpoint": "r3store.leases",
    "Resumed": "r3store.leases",
    "Client": "r3store_client.client",
    "Retry": "r3store_client.client",
    "RolloutWriter": "r3store_client.writer",
    "WriterReport": "r3store_client.writer",
}


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        import importlib

        return getattr(importlib.import_module(_WHERE[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
