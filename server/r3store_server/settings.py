"""Service settings, from `R3STORE_*` environment variables and secret files.

R3STORE_DATA_DIR=/var/lib/r3store          embedded store and SQLite catalog
R3STORE_S3__ENDPOINT_URL=http://minio:9000 use S3 instead (nested: R3STORE_S3__*)
R3STORE_S3__BUCKET=r3store
R3STORE_CATALOG_URL=postgresql+psycopg://... a shared catalog (default: SQLite)
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class S3Settings(BaseModel):
    endpoint_url: str | None = None
    bucket: str = "r3store"
    region: str = "us-east-1"
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    prefix: str = ""


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="R3STORE_", env_nested_delimiter="__", secrets_dir=None, extra="ignore"
    )

    host: str = "127.0.0.1"
    port: int = Field(8330, ge=0, le=65535)
    data_dir: Path = Path("data")
    catalog_url: str | None = None
    s3: S3Settings = Field(default_factory=S3Settings)
    log_level: str = "info"

    @property
    def embedded(self) -> bool:
        """True when no S3 endpoint or bucket is configured: local directory + SQLite."""
        return not self.s3.endpoint_url

    def resolved_catalog_url(self) -> str:
        return self.catalog_url or f"sqlite:///{self.data_dir / 'catalog.db'}"
