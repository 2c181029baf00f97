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
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from pydantic import (
    BaseModel,
    Field,
    FilePath,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

from r3store.errors import InvalidConfig
from r3store.logic.rest import REST_LEVEL
from r3store.policy import MAX_POLICY_VERSION

Role = Literal["writer", "reader", "trainer", "admin"]
LogLevel = Literal["debug", "info", "warning", "error", "critical"]
PREFIX = "R3STORE_"
UPLOAD_COST = 3  # bytes an upload holds per body byte: the body, its routes, their encoding


class S3Settings(BaseModel):
    """Where the shards live. Credentials may come from files (mounted secrets):
    `R3STORE_S3__SECRET_ACCESS_KEY_FILE=/run/secrets/s3-secret`."""

    endpoint_url: str | None = Field(None, description="the S3 endpoint; none: AWS")
    public_endpoint_url: str | None = Field(
        None,
        description="the S3 endpoint trainers reach, signed into direct-read URLs (an "
        "external host where the server uses a cluster-internal name); none: endpoint_url",
    )
    bucket: str = Field("r3store", description="the bucket that holds every object")
    region: str = "us-east-1"
    access_key_id: SecretStr | None = Field(None, description="none: boto3's default")
    secret_access_key: SecretStr | None = Field(None, description="none: boto3's default")
    access_key_id_file: FilePath | None = Field(None, description="a file holding the key id")
    secret_access_key_file: FilePath | None = Field(
        None, description="a file holding the secret key"
    )
    prefix: str = Field("", description="a key prefix before every object key")
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
        "local", description="local: files under the data directory (embedded); s3: a bucket"
    )
    host: str = Field("127.0.0.1", description="the address to listen on")
    port: int = Field(8330, ge=0, le=65535, description="the port to listen on")
    data_dir: Path = Field(
        Path("data"), description="the embedded store and the SQLite catalog live here"
    )
    catalog_url: str | None = Field(
        None, description="a SQLAlchemy database URL; none: SQLite in the data directory"
    )
    s3: S3Settings = Field(default_factory=S3Settings)
    log_level: LogLevel = Field("info", description="the least severe level logged")
    log_json: bool | None = Field(
        None, description="JSON log lines; none: JSON unless stderr is a terminal"
    )
    max_body_bytes: int = Field(128 << 20, ge=1024, description="largest upload accepted")
    auth: Literal["auto", "on", "off"] = Field(
        "auto", description="auto: on when keys are configured; off only on localhost"
    )
    api_keys: list[ApiKeyConfig] = Field(
        default_factory=list, description="a JSON list of {name, role, key or key_sha256}"
    )
    api_keys_file: FilePath | None = Field(
        None, description="a JSON file holding a list like R3STORE_API_KEYS"
    )
    auth_failure_limit: int = Field(
        20,
        ge=0,
        description="unknown API keys one client address may send per minute; then 429 "
        "for the rest of the minute; 0: no limit",
    )
    max_policy_step: int = Field(
        1000,
        ge=1,
        le=2**63 - 1,
        description="how far one call may move a namespace's policy version forward; "
        "further, or back, takes an admin key and force",
    )
    ui_secret: SecretStr | None = Field(
        None,
        min_length=32,
        description="the key that signs the status page's sessions (replicas share it); "
        "none: one made at start, so a restart signs everyone out",
    )
    maintenance_interval: float = Field(
        60.0, ge=0, description="seconds between retention and compaction passes; 0: off"
    )
    maintenance_grace: float = Field(
        600.0, ge=0, description="seconds a retired shard stays readable before deletion"
    )
    maintenance_cold_age: float | None = Field(
        600.0,
        ge=0,
        description="seconds after which shards are merged and compressed again at rest "
        "(dictionaries, a higher zstd level, prompt routes once per group); none: never",
    )
    maintenance_rest_level: int = Field(
        REST_LEVEL,
        ge=1,
        le=22,
        description="the zstd level of rows compressed again at rest (higher: smaller, "
        "more CPU; bench/rest_bench.py measures each level's bytes saved per CPU second)",
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
    upload_memory_per_key: int | None = Field(
        None,
        ge=1 << 20,
        description="the most of the upload memory one API key's uploads may hold at once "
        "(so one writer cannot starve the others); none: half of R3STORE_UPLOAD_MEMORY_BYTES, "
        f"or {UPLOAD_COST + 1}x R3STORE_MAX_BODY_BYTES if more (room for the largest body's "
        "rows beside it), within the budget",
    )
    max_header_bytes: int = Field(
        32 << 10,
        ge=1024,
        description="the most bytes of a request's line and headers; more: 431",
    )
    max_headers: int = Field(100, ge=8, description="the most headers of a request; more: 431")
    header_timeout: float = Field(
        10.0, gt=0, description="seconds a request's line and headers may take to arrive"
    )
    body_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds a request body may lag behind R3STORE_BODY_MIN_RATE; then 408",
    )
    body_min_rate: int = Field(
        1 << 20, ge=1, description="bytes per second a request body must keep arriving at"
    )
    max_plans_per_key: int = Field(
        256,
        ge=1,
        description="write plans one API key may hold not committed and not expired; more: 429",
    )
    send_timeout: float = Field(
        10.0,
        gt=0,
        description="seconds an answer may wait on its client (the connection's send "
        "buffer full) beyond what R3STORE_SEND_MIN_RATE allows; then the connection is "
        "dropped",
    )
    send_min_rate: int = Field(
        1 << 20,
        ge=1,
        description="bytes per second a client must keep reading an answer at, counted "
        "while the answer waits on it",
    )
    keep_alive_timeout: int = Field(
        5, ge=1, description="seconds an idle connection stays open between requests"
    )
    max_connections: int = Field(
        1024,
        ge=16,
        description="open connections; at the limit the longest idle one is closed for a "
        "new one (none idle: the new one is answered 429)",
    )
    backlog: int = Field(2048, ge=1, description="connections waiting to be accepted")
    max_upload_rows: int = Field(
        10_000,
        ge=1,
        le=100_000,  # r3store.protocol.wire.MAX_ROWS
        description="rows (trajectories or segments) one upload may hold; more answer 413",
    )
    max_read_bytes: int = Field(
        256 << 20,
        ge=1 << 20,
        description="the largest answer of a read or a sample, as the format asks for it "
        "(decoded routes for ids and mask); larger ones answer 413 before any is read",
    )
    max_policy_ahead: int = Field(
        16,
        ge=0,
        le=MAX_POLICY_VERSION,
        description="how many versions ahead of its namespace's current policy version an "
        "upload's routes may be; further ahead answer 400",
    )
    metrics_interval: float = Field(
        15.0,
        gt=0,
        description="seconds between gatherings of the per-namespace gauges /metrics serves",
    )

    @field_validator("maintenance_cold_age", mode="before")
    @classmethod
    def _never(cls, value: Any) -> Any:
        if isinstance(value, str) and value.strip().lower() in ("", "null", "none", "never"):
            return None
        return value

    @field_validator("log_level", mode="before")
    @classmethod
    def _lower(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value

    @field_validator("catalog_url")
    @classmethod
    def _database_url(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                make_url(value)
            except ArgumentError:
                raise ValueError(
                    "not a database URL (e.g. postgresql+psycopg://user:pw@host/db)"
                ) from None
        return value

    @model_validator(mode="after")
    def _budget_fits_a_body(self) -> Settings:
        if self.upload_memory_bytes < UPLOAD_COST * self.max_body_bytes:
            raise ValueError(
                f"R3STORE_UPLOAD_MEMORY_BYTES ({self.upload_memory_bytes}) must be at least "
                f"{UPLOAD_COST}x R3STORE_MAX_BODY_BYTES ({self.max_body_bytes}), or the "
                "largest upload could never be admitted"
            )
        share = self.upload_memory_key_bytes
        if share > self.upload_memory_bytes or share < UPLOAD_COST * self.max_body_bytes:
            given = "" if self.upload_memory_per_key is not None else ", by default half the budget"
            raise ValueError(
                f"R3STORE_UPLOAD_MEMORY_PER_KEY ({share}{given}) must be at least "
                f"{UPLOAD_COST}x R3STORE_MAX_BODY_BYTES ({self.max_body_bytes}) and at most "
                f"R3STORE_UPLOAD_MEMORY_BYTES ({self.upload_memory_bytes})"
            )
        return self

    @property
    def upload_memory_key_bytes(self) -> int:
        """The upload memory one key may hold: the setting, or half the budget, but room
        for the largest body and as much again for its rows' decoding (`charge_rows`)
        when the budget has it."""
        if self.upload_memory_per_key is not None:
            return self.upload_memory_per_key
        roomy = (UPLOAD_COST + 1) * self.max_body_bytes
        return min(self.upload_memory_bytes, max(self.upload_memory_bytes // 2, roomy))

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
        if self.store == "s3":
            url = make_url(self.resolved_catalog_url())
            relative = (
                url.get_backend_name() == "sqlite" and not Path(url.database or "").is_absolute()
            )
            if (self.catalog_url is None and not self.data_dir.is_absolute()) or relative:
                raise ValueError(
                    "R3STORE_STORE=s3 needs a catalog that does not depend on the working "
                    "directory: R3STORE_CATALOG_URL (postgresql+psycopg://... for replicas, "
                    "or sqlite:////an/absolute/path.db), or an absolute R3STORE_DATA_DIR"
                )
        return self

    def resolved_catalog_url(self) -> str:
        return self.catalog_url or f"sqlite:///{self.data_dir.absolute() / 'catalog.db'}"

    def catalog_description(self) -> str:
        """The catalog's URL without its password, for logs."""
        return make_url(self.resolved_catalog_url()).render_as_string(hide_password=True)

    def all_keys(self) -> list[ApiKeyConfig]:
        """Keys from settings and from the keys file."""
        keys = list(self.api_keys)
        if self.api_keys_file is not None:
            data = json.loads(self.api_keys_file.read_text())
            if not isinstance(data, list):
                raise ValueError("the file holds no JSON list")
            keys += [ApiKeyConfig.model_validate(item) for item in data]
        return keys

    def loopback_only(self) -> bool:
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host).is_loopback
        except ValueError:
            return False


def variables() -> dict[str, FieldInfo]:
    """Every `R3STORE_*` variable the settings read, with its field."""
    names: dict[str, FieldInfo] = {}
    for name, field in Settings.model_fields.items():
        if name == "s3":
            for sub, info in S3Settings.model_fields.items():
                names[f"{PREFIX}S3__{sub.upper()}"] = info
        else:
            names[f"{PREFIX}{name.upper()}"] = field
    return names


_BOUNDS = {"Ge": ">=", "Gt": ">", "Le": "<=", "Lt": "<"}


def _kind(annotation: Any) -> str:
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(str(a) for a in args)
    if len(args) == 1 and get_origin(annotation) is not list:  # Optional[X], Annotated[X, ...]
        kind = _kind(args[0])
        return "an existing file" if "path_type='file'" in str(annotation) else kind
    words = {int: "an integer", float: "a number", bool: "true or false", str: "text"}
    if annotation in words:
        return words[annotation]
    if annotation is Path:
        return "a path"
    if isinstance(annotation, type) and issubclass(annotation, SecretStr):
        return "text"
    return "JSON"


def accepted(field: FieldInfo) -> str:
    """What a field accepts, in words: `an integer >= 0, <= 65535: the port to listen on`."""
    bounds = [
        f"{_BOUNDS[type(m).__name__]} {getattr(m, type(m).__name__.lower())}"
        for m in field.metadata
        if type(m).__name__ in _BOUNDS
    ]
    text = _kind(field.annotation) + (f" {', '.join(bounds)}" if bounds else "")
    return text + (f" ({field.description})" if field.description else "")


def _one_line(exc: ValidationError) -> str:
    """The first error of `exc` as `R3STORE_PORT='abc': ...; accepted: ...`."""
    error = exc.errors()[0]
    message = str(error["msg"]).removeprefix("Value error, ")
    loc = error["loc"]
    if not loc:  # a rule across settings: its message names them
        return message
    used = 2 if loc[0] == "s3" and len(loc) > 1 else 1
    name = PREFIX + "__".join(str(part).upper() for part in loc[:used])
    where = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc[used:])
    value = error.get("input")
    shown = repr(value) if isinstance(value, str | int | float) and len(str(value)) < 80 else ""
    field = variables().get(name)
    hint = f"; accepted: {accepted(field)}" if field is not None and not where else ""
    return f"{name}{where}{'=' + shown if shown else ''}: {message}{hint}"


# read by the client's examples and scripts, not by the server
CLIENT_VARIABLES = frozenset({f"{PREFIX}URL", f"{PREFIX}KEY"})


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """`R3STORE_*` variables that no setting reads (typos, most likely); the client's
    own (`R3STORE_URL`, `R3STORE_KEY`) are not."""
    known = set(variables()) | CLIENT_VARIABLES
    env = os.environ if environ is None else environ
    return sorted(k for k in env if k.upper().startswith(PREFIX) and k.upper() not in known)


def load_settings() -> Settings:
    """The settings from the environment; `InvalidConfig` in one line naming the variable
    and what it accepts, instead of a validation traceback."""
    try:
        settings = Settings()
    except ValidationError as exc:
        raise InvalidConfig(_one_line(exc)) from None
    except SettingsError as exc:  # a value that is not JSON where JSON is expected
        found = re.search(r'field "(\w+)"', str(exc))
        name = PREFIX + (found.group(1).upper() if found else "*")
        field = variables().get(name)
        raise InvalidConfig(
            f"{name}: not valid JSON" + (f"; accepted: {field.description}" if field else "")
        ) from None
    try:
        settings.all_keys()
    except (OSError, ValueError) as exc:  # not JSON, or an entry that is not a key
        first = exc.errors()[0] if isinstance(exc, ValidationError) else None
        why = f"{first['loc']}: {first['msg']}" if first else str(exc)
        raise InvalidConfig(
            f"{PREFIX}API_KEYS_FILE={str(settings.api_keys_file)!r}: not a JSON list of API "
            f"keys ({why})"
        ) from None
    return settings
