"""Teams: an account's members (console users, each with a role), emailed invitations (only the SHA-256
of a link's token, single use, an expiry), the console user who made each API key, and the account an
audit entry belongs to (a team's activity). Every existing console user with an account becomes its owner.

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "account_members",
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("user_id", sa.Integer(), sa.ForeignKey("console_users.id"), primary_key=True),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.create_index("ix_account_members_user_id", "account_members", ["user_id"])
    op.create_table(
        "account_invites",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("email", sa.String(254), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False, unique=True),
        sa.Column("invited_by_user_id", sa.Integer(), sa.ForeignKey("console_users.id"), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("accepted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("accepted_by_user_id", sa.Integer(), sa.ForeignKey("console_users.id"), nullable=True),
    )
    op.create_index("ix_account_invites_account_created", "account_invites", ["account_id", "created_at"])
    # In place, not in batch mode: a copy of api_keys would have to drop the table the requests point at.
    # SQLite takes the REFERENCES clause only inline (alembic would ALTER a constraint, which it cannot).
    if op.get_bind().dialect.name == "sqlite":
        op.execute("ALTER TABLE api_keys ADD COLUMN created_by_user_id INTEGER REFERENCES console_users (id)")
    else:
        op.add_column("api_keys", sa.Column("created_by_user_id", sa.Integer(),
                                            sa.ForeignKey("console_users.id", name="fk_api_keys_created_by_user_id"),
                                            nullable=True))
    op.create_index("ix_api_keys_created_by_user_id", "api_keys", ["created_by_user_id"])
    op.add_column("audit_log", sa.Column("account_id", sa.Integer(), nullable=True))
    op.create_index("ix_audit_log_account_id", "audit_log", ["account_id"])
    op.execute("INSERT INTO account_members (account_id, user_id, role, created_at) "
               "SELECT account_id, id, 'owner', created_at FROM console_users WHERE account_id IS NOT NULL")


def downgrade() -> None:
    op.drop_index("ix_audit_log_account_id", table_name="audit_log")
    op.drop_column("audit_log", "account_id")
    op.drop_index("ix_api_keys_created_by_user_id", table_name="api_keys")
    if op.get_bind().dialect.name != "sqlite":
        op.drop_constraint("fk_api_keys_created_by_user_id", "api_keys", type_="foreignkey")
    op.drop_column("api_keys", "created_by_user_id")
    op.drop_index("ix_account_invites_account_created", table_name="account_invites")
    op.drop_table("account_invites")
    op.drop_index("ix_account_members_user_id", table_name="account_members")
    op.drop_table("account_members")
