"""The project's exceptions, one hierarchy.

    R3StoreError
    ├── InvalidInput             bad input from a caller; nothing was changed
    │   ├── InvalidRoutes        a route payload that does not match its spec
    │   ├── InvalidSpec          a route spec that cannot describe an MoE model
    │   ├── InvalidRequest       a request that does not match the API's schema
    │   ├── PayloadTooLarge      a body over the service's limit
    │   ├── UnsupportedMediaType a body of the wrong content type
    │   └── DirectUnavailable    direct reads or writes, asked of a store that signs no URLs
    ├── Unauthorized             no API key, or an unknown one
    ├── Forbidden                a key without the right for this
    ├── TooManyFailures          too many unknown API keys from one address; retry later
    ├── NotFound                 a namespace, trajectory or object that does not exist
    │   └── ObjectNotFound       an object store key that does not exist
    ├── Conflict                 the same id with other content, or an existing name
    │   ├── ObjectExists         a create-only put whose key already exists
    │   ├── PlanGone             a write plan no longer planned: committed, collected, or
    │   │                        its namespace deleted (ask for a new one)
    │   ├── LeaseClosed          a lease no longer open: released (or as below)
    │   │   ├── LeaseCommitted   a lease committed already (the commit stands)
    │   │   └── LeaseExpired     a lease past its expiry (its trajectories went back)
    │   └── Fenced               a lease or checkpoint of an epoch before a resume
    ├── RefMismatch              a route ref whose content is no longer stored as named
    ├── StalePolicy              routes older than the namespace's staleness window
    ├── Backpressure             the write buffer is full; retry later
    ├── RequestTimeout           a request's headers or body did not arrive in time
    ├── HeadersTooLarge          a request's headers over the service's limit
    ├── StoreError               the object store failed (after retries)
    ├── CorruptShard             a shard that cannot be read as the format says
    └── InvalidConfig            settings that cannot be used (nothing starts)

Backend errors (botocore, OSError, SQLAlchemy) are translated into these once,
at the boundary where they are raised. Each class has a `code`: the server sends it,
and the client raises the class of that code again (`error_class`).
"""

from __future__ import annotations


class R3StoreError(Exception):
    """Base class of every error r3store raises on purpose."""

    code = "internal"
    status: int | None = None  # the HTTP status it came with, when the client raises it


class InvalidInput(R3StoreError):
    code = "invalid_input"


class InvalidRoutes(InvalidInput):
    code = "invalid_routes"


class InvalidSpec(InvalidInput):
    code = "invalid_spec"


class InvalidRequest(InvalidInput):
    code = "invalid_request"


class PayloadTooLarge(InvalidInput):
    code = "payload_too_large"


class UnsupportedMediaType(InvalidInput):
    code = "unsupported_media_type"


class DirectUnavailable(InvalidInput):
    """The object store hands out no URLs (the embedded store): go through the server."""

    code = "direct_unavailable"


class Unauthorized(R3StoreError):
    code = "unauthorized"


class Forbidden(R3StoreError):
    code = "forbidden"


class TooManyFailures(R3StoreError):
    """A client address that sent too many unknown API keys this minute."""

    code = "too_many_failures"

    def __init__(self, message: str, retry_after: float = 60.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class NotFound(R3StoreError):
    code = "not_found"


class ObjectNotFound(NotFound):
    code = "object_not_found"


class Conflict(R3StoreError):
    code = "conflict"


class ObjectExists(Conflict):
    code = "object_exists"


class PlanGone(Conflict):
    code = "plan_gone"


class LeaseClosed(Conflict):
    """A lease that can no longer be committed, released or renewed; nothing changed."""

    code = "lease_closed"


class LeaseCommitted(LeaseClosed):
    """A lease committed before: its consumption is counted once, and stands."""

    code = "lease_committed"


class LeaseExpired(LeaseClosed):
    """A lease past its expiry: its trajectories returned to the pool uncounted."""

    code = "lease_expired"


class Fenced(Conflict):
    """A lease or checkpoint of the trainer's incarnation before the namespace resumed
    (an older epoch): refused, so that a zombie rank cannot consume for the resumed run."""

    code = "fenced"


class RefMismatch(R3StoreError):
    """A route ref that no longer names what it did: its trajectory deleted (retention),
    rewritten, cut into other segments, or the ref altered. Never resolved to other
    routes; the message names the ref."""

    code = "ref_mismatch"


class StalePolicy(R3StoreError):
    code = "stale_policy"


class Backpressure(R3StoreError):
    """The engine's write buffer stayed full for longer than the caller waits."""

    code = "backpressure"

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestTimeout(R3StoreError):
    """A client sent its request's headers or body too slowly (not a store's slowness)."""

    code = "request_timeout"


class HeadersTooLarge(R3StoreError):
    code = "headers_too_large"


class StoreError(R3StoreError):
    """The object store or the catalog failed or did not answer in time: retryable."""

    code = "store_error"

    def __init__(self, message: str, retry_after: float = 2.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class CorruptShard(R3StoreError):
    code = "corrupt_shard"


class InvalidConfig(R3StoreError):
    """A bad `R3STORE_*` setting: the message names the variable and what it accepts."""

    code = "invalid_config"


def _all(cls: type[R3StoreError]) -> list[type[R3StoreError]]:
    return [cls, *(c for sub in cls.__subclasses__() for c in _all(sub))]


def error_class(code: str) -> type[R3StoreError]:
    """The exception class of an error code (R3StoreError for unknown codes)."""
    for cls in _all(R3StoreError):
        if cls.code == code:
            return cls
    return R3StoreError
