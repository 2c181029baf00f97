"""Consumption by trainers: leases, their trajectories, and step checkpoints.

`namespaces` gains `epoch` (the trainer's incarnation, one more at each resume) and
`consumed` (the number of the namespace's last committed consumption), both 0 for a
namespace that had none; `leases`, `lease_items` and `checkpoints` are created empty.
Sampling counts already stored stay as they are: consumption before this revision is
counted, never undone (no checkpoint precedes it).

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision: str | None = "0001"
branch_labels: str | None = None
depends_on: str | None = None

metadata = sa.MetaData()

leases = sa.Table(
    "leases",
    metadata,
    sa.Column("namespace", sa.String(128), primary_key=True),
    sa.Column("lease_id", sa.String(32), primary_key=True),
    sa.Column("epoch", sa.BigInteger, nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("size", sa.Integer, nullable=False),
    sa.Column("holder", sa.String(64)),
    sa.Column("created_at", sa.Float, nullable=False),
    sa.Column("expires_at", sa.Float, nullable=False),
    sa.Column("closed_at", sa.Float),
    sa.Column("seq", sa.BigInteger),
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
    sa.Column("consumed", sa.BigInteger, nullable=False),
    sa.Column("policy_version", sa.BigInteger, nullable=False),
    sa.Column("created_at", sa.Float, nullable=False),
)


def upgrade() -> None:
    bind = op.get_bind()
    # a catalog with no recorded revision, upgraded from 0001, may have some of these
    present = {c["name"] for c in sa.inspect(bind).get_columns("namespaces")}
    for name in ("epoch", "consumed"):
        if name not in present:
            op.add_column(
                "namespaces", sa.Column(name, sa.BigInteger, nullable=False, server_default="0")
            )
    metadata.create_all(bind)


def downgrade() -> None:
    metadata.drop_all(op.get_bind())
    with op.batch_alter_table("namespaces") as batch:
        batch.drop_column("consumed")
        batch.drop_column("epoch")
