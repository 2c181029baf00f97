"""The object store, catalog and engine that the settings name (the server and the CLI
open them the same way)."""

from __future__ import annotations

from r3store.catalog import Catalog
from r3store.engine import Engine
from r3store.store import LocalStore, ObjectStore, S3Config, S3Store
from r3store_server.settings import Settings


def build_store(settings: Settings) -> ObjectStore:
    """`R3STORE_STORE=local`: files under the data directory; `s3`: the bucket (AWS when
    no endpoint is given, with boto3's default credentials when none are)."""
    if settings.store == "local":
        return LocalStore(settings.data_dir.absolute() / "objects")
    s3 = settings.s3
    key_id, secret = s3.credentials()
    return S3Store(
        S3Config(
            bucket=s3.bucket,
            endpoint_url=s3.endpoint_url,
            region=s3.region,
            access_key_id=key_id,
            secret_access_key=secret,
            prefix=s3.prefix,
            connect_timeout=s3.connect_timeout,
            read_timeout=s3.read_timeout,
            max_attempts=s3.max_attempts,
        )
    )


def build_engine(settings: Settings) -> Engine:
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    catalog = Catalog(settings.resolved_catalog_url(), timeout=settings.catalog_timeout)
    return Engine(build_store(settings), catalog)
