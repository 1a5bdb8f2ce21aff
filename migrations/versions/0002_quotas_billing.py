"""Quotas and billing: per-account limits, trial end, Stripe subscription state, charged price and
idempotency on the ledger, the meter-event outbox and processed Stripe events.

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-02
"""

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

TZ = sa.DateTime(timezone=True)


def upgrade() -> None:
    with op.batch_alter_table("accounts") as batch:
        # Enterprise accounts: their own daily limit (None = the plan's) and dedicated pool.
        batch.add_column(sa.Column("daily_limit_override", sa.Integer))
        batch.add_column(sa.Column("unlimited", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(sa.Column("dedicated_pool", sa.String(128)))
        batch.add_column(sa.Column("stripe_subscription_id", sa.String(64)))
        batch.add_column(sa.Column("subscription_status", sa.String(32)))
        # `created` of the newest Stripe event applied to this account: older ones arrive late and are ignored.
        batch.add_column(sa.Column("billing_event_at", sa.BigInteger))
    with op.batch_alter_table("requests") as batch:
        batch.add_column(sa.Column("billable", sa.Boolean, nullable=False, server_default=sa.true()))
        batch.add_column(sa.Column("price_micros", sa.BigInteger, nullable=False, server_default="0"))
        batch.add_column(sa.Column("plan", sa.String(64)))
        batch.add_column(sa.Column("quota_day", sa.String(10)))
        batch.add_column(sa.Column("idempotency_key", sa.String(255)))
        batch.add_column(sa.Column("body_sha256", sa.String(64)))
        batch.create_unique_constraint("uq_requests_account_idempotency", ["account_id", "idempotency_key"])
        batch.create_index("ix_requests_quota", ["account_id", "quota_day"])
    op.create_table(
        "usage_outbox",
        sa.Column("request_id", sa.String(64), sa.ForeignKey("requests.id"), primary_key=True),
        sa.Column("account_id", sa.Integer, sa.ForeignKey("accounts.id"), nullable=False, index=True),
        sa.Column("day", sa.String(10), nullable=False, index=True),
        sa.Column("created_at", TZ, nullable=False),
        sa.Column("status", sa.String(16), nullable=False, index=True),
        sa.Column("attempts", sa.Integer, nullable=False, server_default="0"),
        sa.Column("next_attempt_at", TZ, nullable=False),
        sa.Column("sent_at", TZ),
        sa.Column("last_error", sa.String(512)),
    )
    op.create_table(
        "stripe_events",
        sa.Column("id", sa.String(255), primary_key=True),
        sa.Column("type", sa.String(128), nullable=False),
        sa.Column("created", sa.BigInteger, nullable=False),
        sa.Column("received_at", TZ, nullable=False),
        sa.Column("outcome", sa.String(64), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("stripe_events")
    op.drop_table("usage_outbox")
    with op.batch_alter_table("requests") as batch:
        batch.drop_index("ix_requests_quota")
        batch.drop_constraint("uq_requests_account_idempotency", type_="unique")
        for column in ("body_sha256", "idempotency_key", "quota_day", "plan", "price_micros", "billable"):
            batch.drop_column(column)
    with op.batch_alter_table("accounts") as batch:
        for column in ("billing_event_at", "subscription_status", "stripe_subscription_id", "dedicated_pool",
                       "unlimited", "daily_limit_override"):
            batch.drop_column(column)
