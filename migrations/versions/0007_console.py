"""The web console's users: an email (unique, stored lower-cased) and an Argon2 password hash for one
account, or for the platform when is_admin; and
when an account took its one self-service trial.

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "console_users",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("email", sa.String(254), nullable=False, unique=True),
        sa.Column("password_hash", sa.String(255), nullable=False),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=True),
        sa.Column("is_admin", sa.Boolean, nullable=False, server_default=sa.false()),
        sa.Column("email_verified_at", sa.DateTime(timezone=True)),
        sa.Column("created_at", sa.DateTime(timezone=True), server_default=sa.func.now(), nullable=False),
    )
    op.create_index("ix_console_users_account_id", "console_users", ["account_id"])
    with op.batch_alter_table("accounts") as batch:
        # The self-service trial is offered once per account: this says it was taken.
        batch.add_column(sa.Column("trial_started_at", sa.DateTime(timezone=True)))


def downgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        batch.drop_column("trial_started_at")
    op.drop_index("ix_console_users_account_id", "console_users")
    op.drop_table("console_users")
