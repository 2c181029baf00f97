"""The project's exceptions, one hierarchy.

    R3StoreError
    ├── InvalidInput             bad input from a caller; nothing was changed
    │   ├── InvalidRoutes        a route payload that does not match its spec
    │   └── InvalidSpec          a route spec that cannot describe an MoE model
    ├── NotFound                 a namespace, trajectory or object that does not exist
    │   └── ObjectNotFound       an object store key that does not exist
    ├── Conflict                 the same id with other content, or an existing name
    │   └── ObjectExists         a create-only put whose key already exists
    ├── StalePolicy              routes older than the namespace's staleness window
    ├── Backpressure             the write buffer is full; retry later
    ├── StoreError               the object store failed (after retries)
    └── CorruptShard             a shard that cannot be read as the format says

Backend errors (botocore, OSError, SQLAlchemy) are translated into these once,
at the boundary where they are raised.
"""

from __future__ import annotations


class R3StoreError(Exception):
    """Base class of every error r3store raises on purpose."""

    code = "internal"


class InvalidInput(R3StoreError):
    code = "invalid_input"


class InvalidRoutes(InvalidInput):
    code = "invalid_routes"


class InvalidSpec(InvalidInput):
    code = "invalid_spec"


class NotFound(R3StoreError):
    code = "not_found"


class ObjectNotFound(NotFound):
    code = "object_not_found"


class Conflict(R3StoreError):
    code = "conflict"


class ObjectExists(Conflict):
    code = "object_exists"


class StalePolicy(R3StoreError):
    code = "stale_policy"


class Backpressure(R3StoreError):
    """The engine's write buffer stayed full for longer than the caller waits."""

    code = "backpressure"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class StoreError(R3StoreError):
    code = "store_error"


class CorruptShard(R3StoreError):
    code = "corrupt_shard"
