"""One catalog per store: the identity object that ties a store prefix to its catalog.

The first server (or `r3store --init`) to open a new, empty store with an empty catalog
gives the catalog an id and writes it, create-only, to the store's `r3store.json`. Every
later open checks that both hold the same id and refuses, naming both, when they do not:
a second, empty or other catalog pointed at the same bucket (another working directory,
a fresh data directory, two deployments sharing a prefix) never works on, or collects,
another catalog's objects. A catalog and store made before identities are bound on
first open when the catalog's shards are in that store.

`r3store rebuild` makes the catalog again from the store and takes the store's identity
(`adopt`).
"""

from __future__ import annotations

import datetime
import json
import time
import uuid
from collections.abc import Callable
from typing import Any

from r3store.catalog import Catalog
from r3store.errors import InvalidConfig, ObjectExists, ObjectNotFound
from r3store.keys import IDENTITY_KEY, SHARD_PREFIX
from r3store.store.base import ObjectStore

REBUILD_HINT = "`r3store rebuild --yes` makes a catalog again from the store alone"


def read_identity(store: ObjectStore) -> dict[str, Any] | None:
    """The store's identity record (`catalog`, `created_at`), or None."""
    try:
        record = json.loads(store.get(IDENTITY_KEY))
    except ObjectNotFound:
        return None
    except ValueError as exc:
        raise InvalidConfig(f"{store.description}: {IDENTITY_KEY} is not JSON: {exc}") from exc
    if not isinstance(record, dict) or not isinstance(record.get("catalog"), str):
        raise InvalidConfig(f"{store.description}: {IDENTITY_KEY} names no catalog")
    return record


def _made(record: dict[str, Any]) -> str:
    when = record.get("created_at")
    if not isinstance(when, int | float):
        return ""
    stamp = datetime.datetime.fromtimestamp(when, datetime.UTC)
    return f", made {stamp:%Y-%m-%d %H:%M} UTC"


def bind(
    store: ObjectStore,
    catalog: Catalog,
    *,
    create: bool,
    where: str = "",
    clock: Callable[[], float] = time.time,
) -> str:
    """Check that `store` and `catalog` belong together and return their id; a new store
    and catalog are bound only when `create`. `where` names the catalog in errors.
    Raises `InvalidConfig` (nothing changed) when they do not belong together."""
    where = where or "this catalog"
    store.ping()  # a missing bucket is said so, not taken for an empty store
    stored = read_identity(store)
    mine = catalog.identity()
    if stored is not None and mine is not None:
        if stored["catalog"] == mine:
            return mine
        raise InvalidConfig(
            f"{store.description} belongs to catalog {stored['catalog']}{_made(stored)}, "
            f"but {where} is catalog {mine}: each store prefix has one catalog; point "
            "R3STORE_CATALOG_URL at the store's own catalog, or this catalog at its own "
            f"store (bucket and prefix, or data directory)"
        )
    if stored is not None:
        state = "empty" if catalog.is_empty() else "another catalog's (it has no identity)"
        raise InvalidConfig(
            f"{store.description} belongs to catalog {stored['catalog']}{_made(stored)}, "
            f"but {where} is {state}: point R3STORE_CATALOG_URL at the catalog that wrote "
            f"this store, or {REBUILD_HINT}"
        )
    if mine is not None:
        raise InvalidConfig(
            f"{where} is catalog {mine}, but {store.description} has no identity "
            f"({IDENTITY_KEY}): is this the store it was made with (R3STORE_S3__BUCKET and "
            f"R3STORE_S3__PREFIX, or R3STORE_DATA_DIR)? If it is, {REBUILD_HINT}"
        )
    return _bind_new(store, catalog, create, where, clock)


def _bind_new(
    store: ObjectStore, catalog: Catalog, create: bool, where: str, clock: Callable[[], float]
) -> str:
    """Neither has an identity: a new deployment, or one made before identities."""
    if catalog.is_empty():
        if any(True for _ in store.list()):
            raise InvalidConfig(
                f"{store.description} holds objects but no identity, and {where} is empty: "
                f"point R3STORE_CATALOG_URL at the catalog that wrote them, or {REBUILD_HINT}"
            )
        if not create:
            raise InvalidConfig(
                f"{store.description} and {where} are new and empty: pass --init to make "
                "a new store there, or point the settings at an existing one"
            )
    else:
        known = catalog.shard_keys()
        present = {info.key for info in store.list(SHARD_PREFIX)}
        if (known and not known & present) or (not known and present):
            raise InvalidConfig(
                f"{where} ({len(known)} shards) and {store.description} ({len(present)} "
                "shards) share none: is this the store it was made with?"
            )
    # the catalog first: replicas racing on one catalog agree on its id, then on the
    # store's, which is written create-only
    return _write(store, catalog, catalog.bind_identity(uuid.uuid4().hex), clock)


def adopt(store: ObjectStore, catalog: Catalog, clock: Callable[[], float] = time.time) -> str:
    """Give `catalog` the store's identity (after a rebuild from that store), or a new
    one written to both when the store has none."""
    stored = read_identity(store)
    if stored is not None:
        return catalog.bind_identity(stored["catalog"], replace=True)
    return _write(store, catalog, catalog.bind_identity(uuid.uuid4().hex, replace=True), clock)


def _write(store: ObjectStore, catalog: Catalog, chosen: str, clock: Callable[[], float]) -> str:
    """Write `chosen` (the catalog's id) as the store's identity, create-only; another
    process of the same catalog may have written it first, another catalog may not."""
    record = {"catalog": chosen, "created_at": clock(), "format": 1}
    try:
        store.put_if_absent(IDENTITY_KEY, json.dumps(record).encode())
    except ObjectExists:
        stored = read_identity(store)
        if stored is None or stored["catalog"] != chosen:
            raise InvalidConfig(
                f"{store.description} was just bound to another catalog "
                f"({None if stored is None else stored['catalog']}): start one deployment "
                "per store prefix"
            ) from None
    return chosen
