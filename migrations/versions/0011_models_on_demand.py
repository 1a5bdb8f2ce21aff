"""Models on demand: how long an on-demand model may sit idle before its fleet puts it to sleep (or
stops it on a CPU host), and LoRA variants, catalog entries whose ``source`` is an adapter served by
the engines of their ``base_model``.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("idle_timeout_s", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("base_model", sa.String(128), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("base_model")
        batch.drop_column("idle_timeout_s")
