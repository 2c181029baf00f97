"""The object store, catalog and engine that the settings name (the server and the CLI
open them the same way), and the lock that keeps one server per SQLite catalog."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from r3store.engine import Engine, EngineConfig
from r3store.errors import InvalidConfig
from r3store.storage.catalog import Catalog, plan_at, upgrade_at
from r3store.storage.store import LocalStore, ObjectStore, S3Config, S3Store
from r3store_server.settings import Settings

# the S3 settings that are not the store's options as they are: `S3Settings.credentials`
CREDENTIAL_SETTINGS = {
    "access_key_id",
    "secret_access_key",
    "access_key_id_file",
    "secret_access_key_file",
}


def build_store(settings: Settings) -> ObjectStore:
    """`R3STORE_STORE=local`: files under the data directory; `s3`: the bucket (AWS when
    no endpoint is given, with boto3's default credentials when none are)."""
    if settings.store == "local":
        return LocalStore(settings.data_dir.absolute() / "objects")
    key_id, secret = settings.s3.credentials()
    options = settings.s3.model_dump(exclude=CREDENTIAL_SETTINGS)  # S3Config's, by name
    return S3Store(S3Config(**options, access_key_id=key_id, secret_access_key=secret))


def build_engine(settings: Settings) -> Engine:
    """The engine over the store and catalog the settings name, not yet bound (the
    caller checks that they belong together: `Engine.upkeep.bind`)."""
    if settings.embedded or settings.catalog_url is None:
        settings.data_dir.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(settings.resolved_catalog_url(), timeout=settings.catalog_timeout)
    try:
        config = EngineConfig(max_policy_ahead=settings.max_policy_ahead)
        return Engine(build_store(settings), catalog, config)
    except BaseException:
        catalog.close()
        raise


def migrate_catalog(settings: Settings, dry_run: bool) -> dict[str, Any]:
    """The catalog's schema brought to the newest revision this code knows, or with
    `dry_run` what that would do (`r3store migrate`); a catalog newer than the code is
    refused (`InvalidConfig`)."""
    url, timeout = settings.resolved_catalog_url(), settings.catalog_timeout
    found = plan_at(url, timeout) if dry_run else upgrade_at(url, timeout)
    return {
        "catalog": settings.catalog_description(),
        "current": found.current,
        "target": found.head,
        "action": found.action,
        "plan": found.describe(),
        "dry_run": dry_run,
    }


def open_engine(settings: Settings, create: bool) -> Engine:
    """The engine the settings name, bound to its store (`bound`)."""
    return bound(build_engine(settings), settings, create)


def bound(engine: Engine, settings: Settings, create: bool) -> Engine:
    """`engine` once bound to its store (`Engine.upkeep.bind`: a store that belongs to another
    catalog, or a catalog older than its store, is refused; a new, empty pair is bound
    only when `create`); closed when refused."""
    try:
        engine.upkeep.bind(create=create, where=f"the catalog {settings.catalog_description()}")
    except BaseException:
        engine.close()
        raise
    return engine


def sqlite_path(settings: Settings) -> Path | None:
    """The SQLite catalog's file, or None for another database."""
    url = make_url(settings.resolved_catalog_url())
    if url.get_backend_name() != "sqlite" or url.database in (None, "", ":memory:"):
        return None
    return Path(url.database).absolute()


@contextlib.contextmanager
def server_lock(settings: Settings) -> Iterator[None]:
    """Held while a server runs on a SQLite catalog: SQLite serves one server process
    (the `r3store` command line may run beside it); a second server is refused, naming
    the first one's pid. Several replicas need PostgreSQL."""
    path = sqlite_path(settings)
    if path is None:
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = path.with_name(path.name + ".server-lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            raise InvalidConfig(
                f"another r3store-server (pid {holder}) runs on the SQLite catalog {path}: "
                "SQLite serves one server; stop it, give this one its own R3STORE_DATA_DIR, "
                "or share a PostgreSQL catalog (R3STORE_CATALOG_URL) between replicas"
            ) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock
