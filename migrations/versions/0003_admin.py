"""Admin API: admin tokens with scopes, the audit log, key expiry (rotation grace), model plans.

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    op.create_table(
        "admin_tokens",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("name", sa.String(128), nullable=False),
        sa.Column("prefix", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("scopes", sa.JSON, nullable=False),
        sa.Column("created_at", TZ, server_default=sa.func.now(), nullable=False),
        sa.Column("created_by", sa.Integer, sa.ForeignKey("admin_tokens.id")),
        sa.Column("last_used_at", TZ),
        sa.Column("revoked_at", TZ),
    )
    op.create_table(
        "audit_log",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("at", TZ, nullable=False, index=True),
        sa.Column("actor_id", sa.Integer, sa.ForeignKey("admin_tokens.id")),
        sa.Column("actor", sa.String(128), nullable=False),
        sa.Column("action", sa.String(64), nullable=False, index=True),
        sa.Column("resource_type", sa.String(32), nullable=False),
        sa.Column("resource_id", sa.String(128), nullable=False),
        sa.Column("before", sa.JSON),
        sa.Column("after", sa.JSON),
    )
    with op.batch_alter_table("api_keys") as batch:
        batch.add_column(sa.Column("expires_at", TZ))
    with op.batch_alter_table("models") as batch:
        batch.add_column(sa.Column("plans", sa.JSON))


def downgrade() -> None:
    with op.batch_alter_table("models") as batch:
        batch.drop_column("plans")
    with op.batch_alter_table("api_keys") as batch:
        batch.drop_column("expires_at")
    op.drop_table("audit_log")
    op.drop_table("admin_tokens")
