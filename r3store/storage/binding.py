"""One catalog per store: the identity object that ties a store prefix to its catalog.

The first server (or `r3store --init`) to open a new, empty store with an empty catalog
gives the catalog an id and writes it, create-only, to the store's `r3store.json`. Every
later open checks that both hold the same id and refuses, naming both, when they do not:
a second, empty or other catalog pointed at the same bucket (another working directory,
a fresh data directory, two deployments sharing a prefix) never works on, or collects,
another catalog's objects. A catalog and store made before identities are bound on
first open when the catalog's shards are in that store.

The identity object also mirrors the catalog's generation, which every maintenance pass
counts up (`advance`): a catalog behind its store (restored from a backup taken before
the last pass) is refused, and deletes nothing, until rebuilt from the store.

`r3store rebuild` makes the catalog again from the store and takes the store's identity
and generation (`adopt`).
"""

from __future__ import annotations

import datetime
import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from r3store.errors import InvalidConfig, ObjectExists, ObjectNotFound
from r3store.storage.catalog import Catalog
from r3store.storage.keys import IDENTITY_KEY, SHARD_PREFIX
from r3store.storage.store.base import ObjectStore

log = logging.getLogger(__name__)

REBUILD_HINT = "`r3store rebuild --yes` makes a catalog again from the store alone"


def read_identity(store: ObjectStore) -> dict[str, Any] | None:
    """The store's identity record (`catalog`, `created_at`, `generation`), or None."""
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


def _generation(record: dict[str, Any]) -> int:
    found = record.get("generation", 0)
    return found if isinstance(found, int) else 0


def behind(store: ObjectStore, catalog: Catalog) -> str | None:
    """Why `catalog` is older than its store (a backup restored), or None."""
    record = read_identity(store)
    if record is None or record["catalog"] != catalog.ledger.identity():
        return None
    mine, stored = catalog.ledger.generation(), _generation(record)
    if mine >= stored:
        return None
    return (
        f"the catalog is older than {store.description} (generation {mine}, the store's "
        f"{stored}: restored from a backup?): it may not know shards written since; "
        f"{REBUILD_HINT}"
    )


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
    Raises `InvalidConfig` (nothing changed) when they do not belong together, or when
    the catalog is older than the store."""
    where = where or "this catalog"
    store.ping()  # a missing bucket is said so, not taken for an empty store
    stored = read_identity(store)
    mine = catalog.ledger.identity()
    if stored is not None and mine is not None:
        if stored["catalog"] != mine:
            raise InvalidConfig(
                f"{store.description} belongs to catalog {stored['catalog']}{_made(stored)}, "
                f"but {where} is catalog {mine}: each store prefix has one catalog; point "
                "R3STORE_CATALOG_URL at the store's own catalog, or this catalog at its own "
                "store (bucket and prefix, or data directory)"
            )
        why = behind(store, catalog)
        if why is not None:
            raise InvalidConfig(f"{where}: {why}")
        return mine
    if stored is not None:
        state = "empty" if catalog.ledger.is_empty() else "another catalog's (it has no identity)"
        raise InvalidConfig(
            f"{store.description} belongs to catalog {stored['catalog']}{_made(stored)}, "
            f"but {where} is {state}: point R3STORE_CATALOG_URL at the catalog that wrote "
            f"this store, or {REBUILD_HINT}"
        )
    if catalog.ledger.is_empty() and mine is None:
        if any(True for _ in store.list()):
            if read_identity(store) is not None:  # another process bound it meanwhile
                return bind(store, catalog, create=create, where=where, clock=clock)
            raise InvalidConfig(
                f"{store.description} holds objects but no identity, and {where} is empty: "
                f"point R3STORE_CATALOG_URL at the catalog that wrote them, or {REBUILD_HINT}"
            )
        if not create:
            raise InvalidConfig(
                f"{store.description} and {where} are new and empty: pass --init to make "
                "a new store there, or point the settings at an existing one"
            )
    else:  # made before identities, or another process of this catalog is binding it
        _check_shared_shards(store, catalog, where)
    # the catalog first: processes racing on one catalog agree on its id (the first
    # recorded wins), then on the store's, which is written create-only
    chosen = mine if mine is not None else catalog.ledger.bind_identity(uuid.uuid4().hex)
    return _write(store, catalog, chosen, clock)


def _check_shared_shards(store: ObjectStore, catalog: Catalog, where: str) -> None:
    known = catalog.shards.all_keys()
    present = {info.key for info in store.list(SHARD_PREFIX)}
    if (known and not known & present) or (not known and present):
        raise InvalidConfig(
            f"{where} ({len(known)} shards) and {store.description} ({len(present)} "
            "shards) share none: is this the store it was made with?"
        )


def adopt(store: ObjectStore, catalog: Catalog, clock: Callable[[], float] = time.time) -> str:
    """Give `catalog` the store's identity and generation (after a rebuild from that
    store), or a new identity written to both when the store has none."""
    stored = read_identity(store)
    if stored is None:
        return _write(
            store, catalog, catalog.ledger.bind_identity(uuid.uuid4().hex, replace=True), clock
        )
    catalog.ledger.bind_identity(stored["catalog"], replace=True)
    mine = catalog.ledger.generation()
    while mine < _generation(stored) and catalog.ledger.advance_generation(mine):
        mine += 1
    return str(stored["catalog"])


def advance(store: ObjectStore, catalog: Catalog, clock: Callable[[], float] = time.time) -> None:
    """Count the generation of a bound catalog up by one, in the catalog and then in the
    store (maintenance, at the end of each pass). Nothing for an unbound store, or one
    whose catalog is behind it."""
    record = read_identity(store)
    if record is None or record["catalog"] != catalog.ledger.identity():
        return
    seen = catalog.ledger.generation()
    if seen < _generation(record) or not catalog.ledger.advance_generation(seen):
        return  # behind (said by `behind`), or another pass counted first
    record = {**record, "generation": seen + 1, "advanced_at": clock()}
    store.put(IDENTITY_KEY, json.dumps(record).encode())


def _write(store: ObjectStore, catalog: Catalog, chosen: str, clock: Callable[[], float]) -> str:
    """Write `chosen` (the catalog's id) as the store's identity, create-only; another
    process of the same catalog may have written it first, another catalog may not."""
    record = {"catalog": chosen, "created_at": clock(), "format": 1, "generation": 0}
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
    else:
        log.info("bound %s to catalog %s", store.description, chosen)
    return chosen
