"""Write plans name their API key: `uploads` gains `writer` (null for uploads planned
before this revision, and for the server's own), so that what one key has planned and
not committed can be bounded.

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision: str | None = "0002"
branch_labels: str | None = None
depends_on: str | None = None

metadata = sa.MetaData()


def upgrade() -> None:
    present = {c["name"] for c in sa.inspect(op.get_bind()).get_columns("uploads")}
    if "writer" not in present:
        op.add_column("uploads", sa.Column("writer", sa.String(64)))


def downgrade() -> None:
    with op.batch_alter_table("uploads") as batch:
        batch.drop_column("writer")
