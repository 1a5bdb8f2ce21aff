"""Shared-key detection: per plan, the distinct client addresses a key may be used from in a UTC day
before its owner is told, and at once before a request from another address is refused (both nullable:
off). The counts themselves live in Redis (keyed hashes in HyperLogLogs), never in SQL.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("shared_key_alert_addresses", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("shared_key_max_addresses", sa.Integer(), nullable=True))


def downgrade() -> None:
    # In place (SQLite >= 3.35, PostgreSQL), as 0015's: batch mode would copy plans and drop the original,
    # which accounts' foreign keys to plans refuse once there are accounts.
    op.drop_column("plans", "shared_key_max_addresses")
    op.drop_column("plans", "shared_key_alert_addresses")
