"""API keys with roles, scoped to namespaces, kept only as SHA-256 digests.

Roles: `writer` (rollout workers: upload, and annotate what they uploaded), `reader`
(read, sample and lease), `trainer` (a reader that also moves the policy version
forward, records step checkpoints and resumes from them),
`admin` (everything: namespaces, settings, forced policy versions, annotating any
trajectory, `/metrics`). A request sends its key as `Authorization: Bearer <key>` or
`X-API-Key: <key>`. Unknown keys are counted per client address (`FailedKeys`): past
the limit, that address is answered 429 for the rest of the minute.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from r3store.catalog_types import ApiKeyRecord
from r3store.errors import Forbidden, R3StoreError, TooManyFailures, Unauthorized
from r3store_server.settings import ApiKeyConfig, Role, Settings

log = logging.getLogger("r3store.server")

# The rights: `describe` (list and describe namespaces), `write` (upload; routes of
# another source only for trajectories the same key wrote), `read` (batch reads, plans,
# sampling, leases, statistics, the status page), `policy` (move the policy version
# forward, a bounded step at a time), `checkpoint` (record, delete and resume from step
# checkpoints), `manage` (create, delete and configure namespaces; set the
# policy version with `force`), `annotate` (routes of another source for any
# trajectory), `operate` (`/metrics`). docs/api.md's role table says the same.
ROLES: dict[Role, set[str]] = {
    "writer": {"write", "describe"},
    "reader": {"read", "describe"},
    "trainer": {"read", "describe", "policy", "checkpoint"},
    "admin": {
        "write",
        "read",
        "describe",
        "policy",
        "checkpoint",
        "manage",
        "annotate",
        "operate",
    },
}


@dataclass(frozen=True)
class Principal:
    name: str
    role: Role
    namespaces: tuple[str, ...]

    def may(self, action: str, namespace: str | None = None) -> bool:
        if action not in ROLES[self.role]:
            return False
        return namespace is None or "*" in self.namespaces or namespace in self.namespaces


ANONYMOUS = Principal("anonymous", "admin", ("*",))


def digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class _Stored:
    digest: bytes
    principal: Principal


class FailedKeys:
    """Unknown keys per client address in the current minute: at `limit` the address is
    refused (429, `TooManyFailures`) until its minute ends. At most `addresses` are
    remembered (the longest quiet forgotten first), so memory stays bounded."""

    def __init__(self, limit: int, window: float = 60.0, addresses: int = 4096) -> None:
        self.limit = limit
        self.window = window
        self.addresses = addresses
        self._seen: OrderedDict[str, tuple[float, int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Addresses remembered now."""
        return len(self._seen)

    def _minute(self, client: str, now: float) -> tuple[float, int]:
        """When `client`'s minute began and the unknown keys it sent in it: once a minute
        is over, a new one with none yet. With the lock held."""
        began, count = self._seen.get(client, (now, 0))
        return (began, count) if now - began < self.window else (now, 0)

    def check(self, client: str | None) -> None:
        """Raise `TooManyFailures` while `client` is over the limit."""
        if client is None or self.limit <= 0:
            return
        now = time.monotonic()
        with self._lock:
            began, count = self._minute(client, now)
        if count >= self.limit:
            wait = self.window - (now - began)
            raise TooManyFailures(
                f"too many unknown API keys from {client}; try again in {wait:.0f} s",
                retry_after=wait,
            )

    def failed(self, client: str | None) -> None:
        """Count an unknown key from `client` (the address forgotten last from now)."""
        if client is None or self.limit <= 0:
            return
        with self._lock:
            began, count = self._minute(client, time.monotonic())
            self._seen.pop(client, None)
            self._seen[client] = (began, count + 1)
            while len(self._seen) > self.addresses:
                self._seen.popitem(last=False)


class KeyRing:
    """The configured keys, and those made with `r3store keys create` (read from the
    catalog, at most `refresh` seconds old, so revocations apply within that time).
    `enabled=False` lets every request through as admin; with `auto`, the first active
    key in the catalog turns authentication on, live, and it stays on until a restart."""

    def __init__(
        self,
        keys: list[ApiKeyConfig],
        enabled: bool,
        auto: bool = False,
        refresh: float = 5.0,
        failures: int = 0,
    ) -> None:
        self.enabled = enabled
        self.failures = FailedKeys(failures)
        self.auto = auto
        self.refresh = refresh
        self._catalog: Callable[[], list[ApiKeyRecord]] | None = None
        self._cached: list[_Stored] = []
        self._cached_at = -1e18
        self._lock = threading.Lock()
        self._keys: list[_Stored] = []
        for key in keys:
            stored = (
                digest(key.key.get_secret_value())
                if key.key is not None
                else bytes.fromhex(key.key_sha256 or "")
            )
            self._keys.append(_Stored(stored, Principal(key.name, key.role, tuple(key.namespaces))))

    def attach(self, load: Callable[[], list[ApiKeyRecord]]) -> None:
        """Also accept the catalog's active keys; in `auto`, turn auth on if there are any."""
        self._catalog = load
        if self._catalog_keys(force=True) and self.auto:
            self.enabled = True
        if self.enabled and not (self._keys or self._cached):
            raise ValueError("auth is on but no API keys are configured")

    @property
    def fresh(self) -> bool:
        """Whether judging a key now reads nothing (the catalog's keys are recent)."""
        return self._catalog is None or time.monotonic() - self._cached_at <= self.refresh

    def _catalog_keys(self, force: bool = False, refresh: bool = True) -> list[_Stored]:
        if self._catalog is None:
            return []
        if not (force or refresh):  # on the event loop: never wait for a refresh
            return self._cached
        with self._lock:
            if force or time.monotonic() - self._cached_at > self.refresh:
                try:
                    records = self._catalog()
                except R3StoreError as exc:  # a catalog outage: keep the keys known so far
                    if force:
                        raise
                    log.warning("cannot refresh API keys from the catalog: %s", exc)
                    records = None
                if records is not None:
                    self._cached = [
                        _Stored(r.digest, Principal(r.name, r.role, tuple(r.namespaces)))  # type: ignore[arg-type]
                        for r in records
                    ]
                self._cached_at = time.monotonic()
            return self._cached

    @classmethod
    def from_settings(cls, settings: Settings) -> KeyRing:
        """Auth is on when keys exist (or `auth=on`); off only for the embedded store on
        a loopback address, and refused anywhere else."""
        keys = settings.all_keys()
        enabled = settings.auth == "on" or (settings.auth == "auto" and bool(keys))
        if not enabled and not (settings.embedded and settings.loopback_only()):
            raise ValueError(
                "refusing to run without API keys: auth may be off only for the embedded "
                "store on a loopback address (set R3STORE_API_KEYS or R3STORE_API_KEYS_FILE)"
            )
        return cls(
            keys, enabled, auto=settings.auth == "auto", failures=settings.auth_failure_limit
        )

    def _turned_on(self, refresh: bool = True) -> bool:
        """In `auto` with auth off: whether a key has since been created in the catalog."""
        if self.auto and not self.enabled and self._catalog_keys(refresh=refresh):
            self.enabled = True
            log.warning("authentication is ON: an API key was created in the catalog")
        return self.enabled

    def authenticate(
        self, presented: str | None, client: str | None = None, refresh: bool = True
    ) -> Principal:
        """The principal of the key `presented` (from the address `client`): 401 without
        one or for an unknown one, 429 for an unknown one while `client` sent too many
        unknown keys. A known key is always let in, whatever its address sent before
        (behind a proxy or NAT many clients share one). `refresh=False`: with the keys
        known now, reading nothing (a caller on the event loop, while `fresh`)."""
        if not self.enabled and not self._turned_on(refresh):
            return ANONYMOUS
        if not presented:
            raise Unauthorized("an API key is required (Authorization: Bearer <key>)")
        return self.authenticate_digest(digest(presented), client, refresh)

    def authenticate_digest(
        self, wanted: bytes, client: str | None = None, refresh: bool = True
    ) -> Principal:
        """As `authenticate`, for a key known by its SHA-256 (the status page's session)."""
        if not self.enabled and not self._turned_on(refresh):
            return ANONYMOUS
        found = None
        for stored in [*self._keys, *self._catalog_keys(refresh=refresh)]:  # no early exit
            if hmac.compare_digest(stored.digest, wanted):
                found = stored.principal
        if found is None:
            self.failures.check(client)  # 429 once the address sent too many
            self.failures.failed(client)
            raise Unauthorized("unknown API key")
        return found

    def authorize(self, principal: Principal, action: str, namespace: str | None = None) -> None:
        if not principal.may(action, namespace):
            where = f" on namespace {namespace!r}" if namespace else ""
            raise Forbidden(f"key {principal.name!r} ({principal.role}) may not {action}{where}")
