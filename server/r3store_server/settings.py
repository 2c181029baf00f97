"""Service settings, from `R3STORE_*` environment variables and secret files.

R3STORE_DATA_DIR=/var/lib/r3store            embedded store and SQLite catalog
R3STORE_STORE=s3                             use S3 instead (nested: R3STORE_S3__*)
R3STORE_S3__ENDPOINT_URL=http://minio:9000   (none: AWS, with boto3's default credentials)
R3STORE_S3__BUCKET=r3store
R3STORE_CATALOG_URL=postgresql+psycopg://... a shared catalog (default: SQLite)
R3STORE_API_KEYS='[{"name": "trainer", "key": "...", "role": "reader"}]'
R3STORE_API_KEYS_FILE=/run/secrets/r3store-keys.json
"""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

Role = Literal["writer", "reader", "admin"]
UPLOAD_COST = 3  # bytes an upload holds per body byte: the body, its routes, their encoding


class S3Settings(BaseModel):
    """Where the shards live. Credentials may come from files (mounted secrets):
    `R3STORE_S3__SECRET_ACCESS_KEY_FILE=/run/secrets/s3-secret`."""

    endpoint_url: str | None = None
    bucket: str = "r3store"
    region: str = "us-east-1"
    access_key_id: SecretStr | None = None
    secret_access_key: SecretStr | None = None
    access_key_id_file: Path | None = None
    secret_access_key_file: Path | None = None
    prefix: str = ""
    connect_timeout: float = Field(5.0, gt=0, description="seconds to connect to S3")
    read_timeout: float = Field(10.0, gt=0, description="seconds S3 may take to answer")
    max_attempts: int = Field(3, ge=1, le=10, description="tries of each S3 request")

    def credentials(self) -> tuple[str | None, str | None]:
        """(access key id, secret key): from the values, else from the files."""

        def pick(value: SecretStr | None, path: Path | None) -> str | None:
            if value is not None:
                return value.get_secret_value()
            return path.read_text().strip() if path is not None else None

        return (
            pick(self.access_key_id, self.access_key_id_file),
            pick(self.secret_access_key, self.secret_access_key_file),
        )


class ApiKeyConfig(BaseModel):
    """One API key: give the key itself (hashed at load, never kept) or its SHA-256."""

    name: str = Field(min_length=1, max_length=64)
    role: Role
    key: SecretStr | None = Field(None, description="the key; at least 24 characters")
    key_sha256: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    namespaces: list[str] = Field(default_factory=lambda: ["*"], description="'*': all")

    @model_validator(mode="after")
    def _one_form(self) -> ApiKeyConfig:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError(f"API key {self.name!r}: give exactly one of key or key_sha256")
        if self.key is not None and len(self.key.get_secret_value()) < 24:
            raise ValueError(f"API key {self.name!r} is shorter than 24 characters")
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="R3STORE_", env_nested_delimiter="__", extra="ignore"
    )

    store: Literal["local", "s3"] = Field(
        "local", description="local: files under data_dir (embedded); s3: the S3 bucket"
    )
    host: str = "127.0.0.1"
    port: int = Field(8330, ge=0, le=65535)
    data_dir: Path = Path("data")
    catalog_url: str | None = None
    s3: S3Settings = Field(default_factory=S3Settings)
    log_level: str = "info"
    log_json: bool = True
    max_body_bytes: int = Field(256 << 20, ge=1024, description="largest upload accepted")
    auth: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: on when keys are configured; off only on localhost"
    )
    api_keys: list[ApiKeyConfig] = Field(default_factory=list)
    api_keys_file: Path | None = None
    maintenance_interval: float = Field(
        60.0, ge=0, description="seconds between retention and compaction passes; 0: off"
    )
    maintenance_grace: float = Field(
        600.0, ge=0, description="seconds a retired shard stays readable before deletion"
    )
    maintenance_orphan_age: float = Field(
        3600.0,
        ge=60,
        description="seconds before an object no catalog row names is deleted "
        "(longer than any commit takes)",
    )
    request_timeout: float = Field(
        30.0, gt=0, description="seconds a request may take before it answers 503"
    )
    readiness_timeout: float = Field(
        3.0, gt=0, description="seconds /readyz waits for the store and the catalog"
    )
    catalog_timeout: float = Field(
        10.0, gt=0, description="seconds a catalog call may wait (connection, lock, query)"
    )
    upload_memory_bytes: int = Field(
        768 << 20,
        ge=1 << 20,
        description=f"memory for uploads in flight ({UPLOAD_COST}x each body); "
        "beyond it uploads answer 429",
    )

    @model_validator(mode="after")
    def _budget_fits_a_body(self) -> Settings:
        if self.upload_memory_bytes < UPLOAD_COST * self.max_body_bytes:
            raise ValueError(
                f"R3STORE_UPLOAD_MEMORY_BYTES ({self.upload_memory_bytes}) must be at least "
                f"{UPLOAD_COST}x R3STORE_MAX_BODY_BYTES ({self.max_body_bytes}), or the "
                "largest upload could never be admitted"
            )
        return self

    @property
    def embedded(self) -> bool:
        """The local store: objects under `data_dir` (and SQLite, unless a catalog URL)."""
        return self.store == "local"

    @model_validator(mode="after")
    def _store_named(self) -> Settings:
        if self.store == "local" and self.s3.endpoint_url:
            raise ValueError(
                "R3STORE_S3__ENDPOINT_URL is set but R3STORE_STORE is local: set "
                "R3STORE_STORE=s3 to use the bucket"
            )
        return self

    def resolved_catalog_url(self) -> str:
        return self.catalog_url or f"sqlite:///{self.data_dir / 'catalog.db'}"

    def all_keys(self) -> list[ApiKeyConfig]:
        """Keys from settings and from the keys file."""
        keys = list(self.api_keys)
        if self.api_keys_file is not None:
            data = json.loads(self.api_keys_file.read_text())
            keys += [ApiKeyConfig.model_validate(item) for item in data]
        return keys

    def loopback_only(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False
