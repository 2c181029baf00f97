"""r3store's catalog schema: the tables as r3store created them when migrations began.

On an empty database: the tables. On a catalog made before migrations and before this
schema, brought up to it in place (what opening such a catalog did before):

- made before route sources (no `trajectories.source`): the table is made again with the
  source in its key and the rows copied as `engine` routes;
- made before compression at rest or before writers were recorded: the columns it lacks
  are added, empty (no dictionary, no shared prefix, writer unknown), and `shards`
  gains `rest_level`;
- made before the statistics or the ledger: those tables are created, and the
  dictionaries its rows name are recorded as this catalog's.

The tables are a frozen copy: a later change of the schema is a later revision, never
an edit of this one.

Revision ID: 0001
Revises: none
"""

from __future__ import annotations

import time

import sqlalchemy as sa
from alembic import op
from sqlalchemy.engine import Connection

revision = "0001"
down_revision: str | None = None
branch_labels: str | None = None
depends_on: str | None = None

ENGINE = "engine"

metadata = sa.MetaData()

namespaces = sa.Table(
    "namespaces",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
)


shards = sa.Table(
    "shards",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("namespace", sa.String(128), nullable=False, index=True),
    sa.Column("size", sa.BigInteger, nullable=False),
    sa.Column("num_rows", sa.Integer, nullable=False),
    sa.Column("route_bytes", sa.BigInteger, nullable=False),  # of all its rows, as written
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("retired_at", sa.Float),  # no rows point here since; object goes after a grace
    sa.Column("rest_level", sa.SmallInteger),  # zstd level of a shard written at rest
)


trajectories = sa.Table(
    "trajectories",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("trajectory_id", sa.String(256), primary_key=True),
    sa.Column("source", sa.String(16), primary_key=True, server_default=ENGINE),
    sa.Column("start", sa.BigInteger, primary_key=True),
    sa.Column("group_id", sa.String(256)),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("num_tokens", sa.Integer, nullable=False),
    sa.Column("prompt_len", sa.Integer, nullable=False),
    sa.Column("digest", sa.LargeBinary(16), nullable=False),
    sa.Column("route_bytes", sa.BigInteger, nullable=False),
    sa.Column("shard_key", sa.String(512), nullable=False, index=True),
    sa.Column("row_group", sa.Integer, nullable=False),
    sa.Column("row_index", sa.Integer, nullable=False),
    sa.Column("transform", sa.SmallInteger, nullable=False),
    sa.Column("ids_offset", sa.BigInteger, nullable=False),
    sa.Column("ids_length", sa.BigInteger, nullable=False),
    sa.Column("counts_offset", sa.BigInteger),
    sa.Column("counts_length", sa.BigInteger),
    sa.Column("order_offset", sa.BigInteger),
    sa.Column("order_length", sa.BigInteger),
    sa.Column("tokens_offset", sa.BigInteger),
    sa.Column("tokens_length", sa.BigInteger),
    # compression at rest: the ids streams' zstd dictionary, and the shared prefix
    # (a row of the same shard) this segment continues
    sa.Column("dictionary", sa.LargeBinary(16)),
    sa.Column("prefix_tokens", sa.Integer, nullable=False, server_default="0"),
    sa.Column("prefix_digest", sa.LargeBinary(16)),
    sa.Column("prefix_transform", sa.SmallInteger),
    sa.Column("prefix_ids_offset", sa.BigInteger),
    sa.Column("prefix_ids_length", sa.BigInteger),
    sa.Column("prefix_counts_offset", sa.BigInteger),
    sa.Column("prefix_counts_length", sa.BigInteger),
    sa.Column("prefix_order_offset", sa.BigInteger),
    sa.Column("prefix_order_length", sa.BigInteger),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("times_sampled", sa.Integer, nullable=False, default=0),
    sa.Column("writer", sa.String(64)),  # the key that uploaded it (None: unknown)
    sa.Index("ix_trajectories_group", "namespace", "group_id"),
    sa.Index("ix_trajectories_version", "namespace", "policy_version"),
)


api_keys = sa.Table(
    "api_keys",
    metadata,
    sa.Column("name", sa.String(64), primary_key=True),
    sa.Column("role", sa.String(16), nullable=False),
    sa.Column("namespaces", sa.Text, nullable=False),  # JSON list; ["*"]: all
    sa.Column("digest", sa.LargeBinary(32), nullable=False),  # SHA-256 of the key
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("revoked_at", sa.Float),
)


expert_load = sa.Table(
    "expert_load",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("shard_key", sa.String(512), primary_key=True),
    sa.Column("policy_version", sa.BigInteger, primary_key=True),
    sa.Column("source", sa.String(16), primary_key=True),
    sa.Column("tokens", sa.BigInteger, nullable=False),
    sa.Column("counts", sa.LargeBinary, nullable=False),  # [L, E]
)


route_agreement = sa.Table(
    "route_agreement",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("trajectory_id", sa.String(256), primary_key=True),
    sa.Column("start", sa.BigInteger, primary_key=True),
    sa.Column("source_a", sa.String(16), primary_key=True),
    sa.Column("source_b", sa.String(16), primary_key=True),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("tokens", sa.BigInteger, nullable=False),
    sa.Column("matches", sa.LargeBinary, nullable=False),  # [L]
    sa.Column("slots", sa.LargeBinary, nullable=False),  # [L]
    sa.Index("ix_agreement_version", "namespace", "source_a", "source_b", "policy_version"),
)


catalog_meta = sa.Table(
    "catalog_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.Text, nullable=False),
)


uploads = sa.Table(
    "uploads",
    metadata,
    sa.Column("key", sa.String(512), primary_key=True),
    sa.Column("namespace", sa.String(128), nullable=False, index=True),
    sa.Column("kind", sa.String(16), nullable=False),
    sa.Column("planned_at", sa.Float, nullable=False),
)


dictionaries = sa.Table(
    "dictionaries",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("digest", sa.LargeBinary(16), primary_key=True),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("used_at", sa.Float, nullable=False),
)


def upgrade() -> None:
    bind = op.get_bind()
    inspector = sa.inspect(bind)
    older = inspector.has_table("trajectories")
    ledger_is_new = not inspector.has_table("dictionaries")
    if older:
        _add_sources(bind)
        _add_columns(bind)
    metadata.create_all(bind)
    if older and ledger_is_new:  # a catalog made before the ledger: the dictionaries it uses
        bind.execute(
            sa.text(
                "INSERT INTO dictionaries (namespace, digest, policy_version, used_at) "
                "SELECT namespace, dictionary, MIN(policy_version), :now FROM trajectories "
                "WHERE dictionary IS NOT NULL GROUP BY namespace, dictionary"
            ),
            {"now": time.time()},
        )


def downgrade() -> None:
    metadata.drop_all(op.get_bind())


def _add_sources(bind: Connection) -> None:
    """A catalog made before route sources: its trajectory rows are engine routes, and
    the source joins the key. The table is made again under the new key and the rows
    copied."""
    inspector = sa.inspect(bind)
    old = [c["name"] for c in inspector.get_columns("trajectories")]
    if "source" in old:
        return
    listed = ", ".join(old)
    key = inspector.get_pk_constraint("trajectories").get("name")
    if key and bind.dialect.name != "sqlite":  # named per schema in PostgreSQL
        bind.execute(sa.text(f"ALTER TABLE trajectories DROP CONSTRAINT {key}"))
    for index in inspector.get_indexes("trajectories"):
        bind.execute(sa.text(f"DROP INDEX {index['name']}"))
    bind.execute(sa.text("ALTER TABLE trajectories RENAME TO trajectories_before_sources"))
    trajectories.create(bind)
    bind.execute(
        sa.text(
            f"INSERT INTO trajectories ({listed}, source) "
            f"SELECT {listed}, '{ENGINE}' FROM trajectories_before_sources"
        )
    )
    bind.execute(sa.text("DROP TABLE trajectories_before_sources"))


def _add_columns(bind: Connection) -> None:
    """A catalog made before compression at rest (or before writers were recorded): the
    columns it lacks are added, empty."""
    inspector = sa.inspect(bind)
    for table in (trajectories, shards):
        if not inspector.has_table(table.name):
            continue
        present = {c["name"] for c in inspector.get_columns(table.name)}
        for column in table.columns:
            if column.name in present:
                continue
            kind = column.type.compile(dialect=bind.dialect)
            default = column.server_default
            if default is not None:  # a literal: the value rows made before it hold
                kind += f" NOT NULL DEFAULT '{default.arg}'"  # type: ignore[attr-defined]
            bind.execute(sa.text(f"ALTER TABLE {table.name} ADD COLUMN {column.name} {kind}"))
