"""API keys with roles, scoped to namespaces, kept only as SHA-256 digests.

Roles: `writer` (rollout workers: upload), `reader` (trainers: read, sample, set the
policy version), `admin` (everything, including namespaces and settings). A request
sends its key as `Authorization: Bearer <key>` or `X-API-Key: <key>`.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from r3store.errors import Forbidden, Unauthorized
from r3store_server.settings import ApiKeyConfig, Role, Settings

ROLES: dict[Role, set[str]] = {
    "writer": {"write", "describe"},
    "reader": {"read", "describe", "policy"},
    "admin": {"write", "read", "describe", "policy", "manage", "operate"},
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


class KeyRing:
    """The configured keys. `enabled=False` lets every request through as admin."""

    def __init__(self, keys: list[ApiKeyConfig], enabled: bool) -> None:
        self.enabled = enabled
        self._keys = []
        for key in keys:
            stored = (
                digest(key.key.get_secret_value())
                if key.key is not None
                else bytes.fromhex(key.key_sha256 or "")
            )
            self._keys.append(_Stored(stored, Principal(key.name, key.role, tuple(key.namespaces))))

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
        if enabled and not keys:
            raise ValueError("auth is on but no API keys are configured")
        return cls(keys, enabled)

    def authenticate(self, presented: str | None) -> Principal:
        if not self.enabled:
            return ANONYMOUS
        if not presented:
            raise Unauthorized("an API key is required (Authorization: Bearer <key>)")
        wanted = digest(presented)
        found = None
        for stored in self._keys:  # compare against every key: no early exit
            if hmac.compare_digest(stored.digest, wanted):
                found = stored.principal
        if found is None:
            raise Unauthorized("unknown API key")
        return found

    def authorize(self, principal: Principal, action: str, namespace: str | None = None) -> None:
        if not principal.may(action, namespace):
            where = f" on namespace {namespace!r}" if namespace else ""
            raise Forbidden(f"key {principal.name!r} ({principal.role}) may not {action}{where}")
