"""The Batch API: batches and their lines (each line's progress and result, so a restarted gateway
resumes a batch where it stood), and per plan the batch discount (percent off the per-request price)
and the batch allowance (lines per quota day, apart from the live daily limit: at first the same
number as that limit).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("plans") as batch:
        batch.add_column(sa.Column("batch_discount_percent", sa.Integer(), nullable=False, server_default="50"))
        batch.add_column(sa.Column("batch_daily_limit", sa.Integer(), nullable=True))
    op.execute("UPDATE plans SET batch_daily_limit = daily_limit")
    op.create_table(
        "batches",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("api_key_id", sa.Integer(), sa.ForeignKey("api_keys.id"), nullable=False),
        sa.Column("endpoint", sa.String(64), nullable=False),
        sa.Column("input_file_id", sa.String(64), nullable=False),
        sa.Column("completion_window", sa.String(8), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("metadata", sa.JSON(), nullable=True),
        sa.Column("errors", sa.JSON(), nullable=True),
        sa.Column("output_file_id", sa.String(64), nullable=True),
        sa.Column("error_file_id", sa.String(64), nullable=True),
        sa.Column("total", sa.Integer(), nullable=False),
        sa.Column("completed", sa.Integer(), nullable=False),
        sa.Column("failed", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("expires_at", sa.DateTime(timezone=True), nullable=False),
        *(sa.Column(f"{moment}_at", sa.DateTime(timezone=True), nullable=True)
          for moment in ("in_progress", "finalizing", "completed", "failed", "expired", "cancelling", "cancelled")),
    )
    op.create_index("ix_batches_status", "batches", ["status"])
    op.create_index("ix_batches_account", "batches", ["account_id", "created_at"])
    op.create_table(
        "batch_lines",
        sa.Column("batch_id", sa.String(64), sa.ForeignKey("batches.id"), primary_key=True),
        sa.Column("line", sa.Integer(), primary_key=True, autoincrement=False),
        sa.Column("custom_id", sa.String(512), nullable=False),
        sa.Column("model", sa.String(128), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("status_code", sa.Integer(), nullable=True),
        sa.Column("result", sa.Text(), nullable=True),
    )
    op.create_index("ix_batch_lines_status", "batch_lines", ["status", "batch_id"])


def downgrade() -> None:
    op.drop_index("ix_batch_lines_status", table_name="batch_lines")
    op.drop_table("batch_lines")
    op.drop_index("ix_batches_account", table_name="batches")
    op.drop_index("ix_batches_status", table_name="batches")
    op.drop_table("batches")
    # ALTER TABLE ... DROP COLUMN in place (SQLite >= 3.35, PostgreSQL): batch mode would copy plans and
    # drop the original, which accounts' foreign keys to plans refuse once there are accounts.
    op.drop_column("plans", "batch_daily_limit")
    op.drop_column("plans", "batch_discount_percent")
