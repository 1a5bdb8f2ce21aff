"""Quota alerts: an account's alert settings (its thresholds as percents of the daily quota, email on or
off, a webhook URL and its signing secret; no row: the defaults, 80 % and 100 % by email) and every
alert delivery, one row per account, quota day, threshold and channel (a unique key, so however many
gateway processes race, a delivery is recorded, and sent, once).

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-06
"""

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "quota_alert_settings",
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), primary_key=True),
        sa.Column("thresholds", sa.JSON(), nullable=False),
        sa.Column("email_enabled", sa.Boolean(), nullable=False, server_default=sa.true()),
        sa.Column("webhook_url", sa.String(2048), nullable=True),
        sa.Column("webhook_secret", sa.String(64), nullable=True),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )
    op.create_table(
        "quota_alert_deliveries",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column("account_id", sa.Integer(), sa.ForeignKey("accounts.id"), nullable=False),
        sa.Column("quota_day", sa.String(10), nullable=False),
        sa.Column("threshold", sa.Integer(), nullable=False),
        sa.Column("channel", sa.String(16), nullable=False),
        sa.Column("used", sa.Integer(), nullable=False),
        sa.Column("daily_limit", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
        sa.Column("next_attempt_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("sent_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("last_error", sa.String(512), nullable=True),
        sa.UniqueConstraint("account_id", "quota_day", "threshold", "channel", name="uq_quota_alert_delivery"),
    )
    op.create_index("ix_quota_alert_deliveries_due", "quota_alert_deliveries", ["status", "next_attempt_at"])


def downgrade() -> None:
    op.drop_index("ix_quota_alert_deliveries_due", table_name="quota_alert_deliveries")
    op.drop_table("quota_alert_deliveries")
    op.drop_table("quota_alert_settings")
