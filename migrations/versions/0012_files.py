"""The Files API (``/v1/files``): each account's files (their bytes live in the gateway's file store, a
local folder or an S3 bucket) and what each account keeps there, for its caps.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("filename", sa.String(255), nullable=False),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=True),
    )
    op.create_index("ix_files_account_created", "files", ["account_id", "created_at", "id"])
    op.create_index("ix_files_expires_at", "files", ["expires_at"])
    op.create_table(
        "file_usage",
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("files", sa.Integer, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("file_usage")
    op.drop_index("ix_files_expires_at", table_name="files")
    op.drop_index("ix_files_account_created", table_name="files")
    op.drop_table("files")
