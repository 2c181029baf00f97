"""The catalog's tables, on SQLAlchemy Core: one `metadata` (docs/format.md, "Catalog").

- `namespaces`, `shards`, `trajectories`: what the store holds and where each trajectory
  segment lies (a rebuild makes them again from the shards).
- `api_keys`: the server's API keys (digests only).
- `expert_load`, `route_agreement`: statistics (`r3store.storage.catalog.stats`).
- `catalog_meta`, `uploads`, `dictionaries`: the ledger of what this catalog owns in the
  store (`r3store.storage.catalog.ledger`).
- `leases`, `lease_items`, `checkpoints` (and the namespace's `epoch` and `consumed`):
  consumption by trainers (`r3store.storage.catalog.leases` and `.checkpoints`).

These are the tables as the code reads and writes them now; a database gets them through
the migrations (`r3store.storage.catalog.migrations`), which hold their own frozen copy.
"""

from __future__ import annotations

import sqlalchemy as sa

from r3store.policy import ENGINE

metadata = sa.MetaData()

namespaces = sa.Table(
    "namespaces",
    metadata,
    sa.Column("name", sa.String(128), primary_key=True),
    sa.Column("spec", sa.Text, nullable=False),
    sa.Column("settings", sa.Text, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    # the trainer's incarnation (one more at each resume) and the number of the last
    # committed consumption
    sa.Column("epoch", sa.BigInteger, nullable=False, server_default="0"),
    sa.Column("consumed", sa.BigInteger, nullable=False, server_default="0"),
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
    sa.Column("writer", sa.String(64)),  # the API key a write plan is for (None: the server)
)


dictionaries = sa.Table(
    "dictionaries",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("digest", sa.LargeBinary(16), primary_key=True),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("used_at", sa.Float, nullable=False),
)


leases = sa.Table(
    "leases",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("lease_id", sa.String(32), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),  # r3store.leases.LeaseState
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("holder", sa.String(64)),  # the key that took it (None: no keys)
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("closed_at", sa.Float),
    sa.Column("seq", sa.BigInteger),  # its place in the namespace's consumption, once committed
    sa.Column("commit_token", sa.String(32)),  # what the commit was sent with (its retries)
    sa.Index("ix_leases_state", "namespace", "state"),
    sa.Index("ix_leases_seq", "namespace", "seq"),
)


lease_items = sa.Table(
    "lease_items",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("lease_id", sa.String(32), primary_key=True),
    sa.Column("position", sa.Integer, primary_key=True),
    sa.Column("trajectory_id", sa.String(256), nullable=False),
    sa.Index("ix_lease_items_trajectory", "namespace", "trajectory_id"),
)


checkpoints = sa.Table(
    "checkpoints",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("step", sa.BigInteger, primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("consumed", sa.BigInteger, nullable=False),  # the namespace's, when recorded
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)
