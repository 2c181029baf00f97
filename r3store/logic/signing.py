"""Signed tokens: small JSON values the server hands out and takes back unchanged (a
write plan), whose integrity an HMAC-SHA256 under a secret of the catalog proves, so
that any replica sharing the catalog can check one without a lookup. No I/O.

    token = sign(secret, {"n": "run1", "k": "shards/run1/...blob"})
    fields = verify(secret, token)   # InvalidInput unless this secret signed it
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
from typing import Any

from r3store.errors import InvalidInput

MAX_TOKEN_CHARS = 2048


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(secret: bytes, fields: dict[str, Any]) -> str:
    """`fields` as a URL-safe token: their JSON, a dot, and its MAC."""
    payload = json.dumps(fields, separators=(",", ":"), sort_keys=True).encode()
    mac = hmac.new(secret, payload, hashlib.sha256).digest()
    return f"{_b64(payload)}.{_b64(mac)}"


def verify(secret: bytes, token: str, what: str = "token") -> dict[str, Any]:
    """The fields of a token `sign(secret, ...)` made; `InvalidInput` for anything else
    (the MAC compared in constant time, before the payload is parsed)."""
    refused = InvalidInput(f"not a {what} this service made (or it was altered)")
    if not isinstance(token, str) or len(token) > MAX_TOKEN_CHARS or token.count(".") != 1:
        raise refused
    payload_text, mac_text = token.split(".")
    try:
        payload, mac = _unb64(payload_text), _unb64(mac_text)
    except (binascii.Error, ValueError):
        raise refused from None
    if not hmac.compare_digest(mac, hmac.new(secret, payload, hashlib.sha256).digest()):
        raise refused
    fields = json.loads(payload)
    if not isinstance(fields, dict):
        raise refused
    return fields
