"""The r3store client: rollout workers write routes, trainers read and replay them.

`Client`, `RolloutWriter` and the converters need no torch; `r3store_client.tensors`,
`r3store_client.reader` and `r3store_client.replay` do (`pip install 'r3store[torch]'`), and
`r3store_client.megatron` needs megatron-core too (`'r3store[megatron]'`).
"""

from r3store_client.client import Client, Retry
from r3store_client.writer import RolloutWriter, WriterReport

__all__ = ["Client", "Retry", "RolloutWriter", "WriterReport"]
