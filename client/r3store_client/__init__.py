"""The r3store client: rollout workers write routes, trainers read and replay them.

`Client`, `RolloutWriter` and the converters need no torch; `r3store_client.tensors`,
`r3store_client.reader` and `r3store_client.replay` do (`pip install 'r3store[torch]'`), and
`r3store_client.megatron` needs megatron-core too (`'r3store[megatron]'`). Importing one
module loads only what it needs: the replay modules do not load the HTTP client.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from r3store_client.client import Client, Retry
    from r3store_client.writer import RolloutWriter, WriterReport

__all__ = ["Client", "Retry", "RolloutWriter", "WriterReport"]
_WHERE = {
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
